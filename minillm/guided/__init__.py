"""Structured outputs from scratch (lesson 12): constrain generation to a regex, a choice, a JSON
schema or a grammar.

    regex / choice --regex.py--> DFA over UTF-8 bytes
        --token_automaton.py--> per state: the allowed tokens (a mask) and where each leads
    json schema --json_schema.py--> grammar (EBNF) --grammar.py--> one DFA per rule
        --pushdown.py--> a stack of calls; masks per configuration, cached per top frame
    guide.py: the per-request state, the logits mask each step, jump-forward decoding

Used through SamplingParams(guided_decoding=GuidedDecodingParams(json=... | regex=... |
choice=[...] | grammar=... | json_object=True)); OutputProcessor.append (minillm/engine/output_processor.py) masks the logits before sampling, on every
path (the engine, the batch-1 contiguous path, LLM.stream, the server). Guarantees: a request
that finishes with "stop" matches its regex or grammar (its JSON validates); one cut by max_tokens (or a
stop string) finishes with "length" (or "stop") and its text is a PREFIX of a valid output, not
a valid document. With speculative decoding, drafts end where the grammar forbids one and the
target's rows are masked by the state each continues (minillm/speculative/engine.py).
"""
from .grammar import Grammar
from .guide import Guide, GuideState, compile_guide, guide_source
from .json_schema import schema_to_grammar
from .pushdown import PushdownAutomaton
from .regex import DFA, compile_regex

__all__ = ["DFA", "Grammar", "Guide", "GuideState", "PushdownAutomaton", "compile_guide", "compile_regex",
           "guide_source", "schema_to_grammar"]
