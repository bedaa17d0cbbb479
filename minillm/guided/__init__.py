"""Structured outputs from scratch (lesson 12): constrain generation to a regex, a choice or a
JSON schema.

    json schema --json_schema.py--> regex --regex.py--> DFA over UTF-8 bytes
        --token_automaton.py--> per state: the allowed tokens (a mask) and where each leads
    guide.py: the per-request state, the logits mask each step, jump-forward decoding

Used through SamplingParams(guided_decoding=GuidedDecodingParams(json=... | regex=... |
choice=[...] | json_object=True)); OutputProcessor.append (minillm/engine/output_processor.py) masks the logits before sampling, on every
path (the engine, the batch-1 contiguous path, LLM.stream, the server). Guarantees: a request
that finishes with "stop" matches its regex (its JSON validates); one cut by max_tokens (or a
stop string) finishes with "length" (or "stop") and its text is a PREFIX of a valid output, not
a valid document. Speculative decoding with a guide is refused.
"""
from .guide import Guide, GuideState, compile_guide, guide_regex
from .json_schema import schema_to_regex
from .regex import DFA, compile_regex

__all__ = ["DFA", "Guide", "GuideState", "compile_guide", "compile_regex", "guide_regex", "schema_to_regex"]
