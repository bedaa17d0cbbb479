"""Structured outputs (minillm/guided): the regex engine against Python's re, JSON schema ->
grammar against jsonschema, the token mask against a brute-force walk, and guided generation on
the tiny random model through every path (engine, contiguous batch-1, stream). The grammar
engine itself: tests/guided/test_grammar.py."""
import json
import random
import re

import pytest
import torch

from helpers import CharTokenizer
from minillm import LLM, GuidedDecodingParams, SamplingParams
from minillm.guided.guide import GuideState, compile_guide
from minillm.guided.grammar import Grammar
from minillm.guided.json_schema import schema_to_grammar
from minillm.guided.pushdown import PushdownAutomaton
from minillm.guided.regex import compile_regex
from minillm.guided.token_automaton import TokenAutomaton, TokenVocabulary, allowed_tokens
from minillm.model.llama import random_model, tiny_config

PATTERNS = ["abc", "a|bc*", "[a-c]{2,3}", "(?:ab)+c?", "[^b]*", ".{1,3}", r"\d+\.\d?", "x?y*", "(a|b)*abb",
            r"[\-a]+", r"\w\s\W", "(?:é|€)+ü", "a{3}|b{2,}"]
ALPHABET = "abcxy1.-é€ü\n "


@pytest.mark.parametrize("pattern", PATTERNS)
def test_regex_matches_like_python_re(pattern):
    dfa = compile_regex(pattern)
    rng = random.Random(pattern)
    for _ in range(400):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 6)))
        assert dfa.matches(text) == (re.fullmatch(pattern, text, re.ASCII) is not None), text


def test_byte_dfa_splits_characters_like_the_tokenizer_may():
    """'€' is 3 UTF-8 bytes: a token holding its first 2 bytes is a live prefix, 2 bytes of 'ü' are not."""
    dfa = compile_regex("€+")
    half = dfa.walk(dfa.start, "€".encode()[:2])
    assert half != dfa.dead and not dfa.accepting[half]
    assert dfa.accepting[dfa.walk(half, "€".encode()[2:])]
    assert dfa.walk(dfa.start, "ü".encode()[:1]) == dfa.dead


@pytest.mark.parametrize("pattern, message", [("a(b", "missing"), ("a**", "nothing to repeat"), ("^a", "anchors"),
                                              ("a{5,2}", "m <= n"), ("(?=a)", "non-capturing"), (r"\q", "escape"),
                                              ("a*?", "lazy"), ("[]", "empty class")])
def test_bad_regex_is_a_value_error(pattern, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        compile_regex(pattern)


SCHEMAS = {
    "person": ({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                 "age": {"type": "integer"},
                                                 "email": {"type": ["string", "null"]}},
                "required": ["name", "age"]},
               [{"name": "Ada", "age": 36}, {"name": "A\"b\\", "age": -1, "email": None},
                {"name": "x", "age": 0, "email": "a@b"}]),
    "nested": ({"type": "object", "properties": {"id": {"const": 7},
                                                 "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                          "minItems": 1, "maxItems": 3},
                                                 "pos": {"$ref": "#/$defs/point"}},
                "required": ["tags", "pos"], "$defs": {"point": {
                    "type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                    "required": ["x", "y"], "additionalProperties": False}}},
               [{"tags": ["a"], "pos": {"x": 1.5, "y": -2e3}}, {"id": 7, "tags": ["b", "a", "a"], "pos": {"x": 0, "y": 1}}]),
    "list": ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, [[1, 2], [0, -3, 12]]),
    "any": ({"type": "object"}, [{}, {"k": [1, "v", {"z": None}]}, {"a": True, "b": 1.25}]),
    "choice": ({"anyOf": [{"type": "boolean"}, {"type": "string", "pattern": "^[a-z]{2,4}-[0-9]$"}]},
               [True, "ab-1", "abcd-9"]),
}
NOT_VALID = {"person": [{"age": 3}, {"name": "Ada", "age": 3, "extra": 1}, {"name": "a" * 13, "age": 1}],
             "nested": [{"tags": [], "pos": {"x": 1, "y": 2}}, {"id": 8, "tags": ["a"], "pos": {"x": 1, "y": 2}}],
             "list": [[1], [], [1, 2.5]], "any": [[1], "x"], "choice": ["abcde-1", 3]}


def schema_matcher(schema):
    """text -> does the schema's grammar accept it (walked byte by byte through the pushdown automaton)."""
    pda = PushdownAutomaton(Grammar(schema_to_grammar(schema)), TokenVocabulary([b"x"], None))

    def matches(text: str) -> bool:
        config = pda.start
        for b in text.encode():
            config = pda.step(config, b)
        return pda.is_accepting(config)
    return matches


@pytest.mark.parametrize("name", SCHEMAS)
def test_schema_grammar_accepts_valid_documents_and_rejects_invalid(name):
    jsonschema = pytest.importorskip("jsonschema")
    schema, documents = SCHEMAS[name]
    matches = schema_matcher(schema)
    for doc in documents:
        jsonschema.validate(doc, schema)
        assert matches(json.dumps(doc)), doc
    for doc in NOT_VALID[name]:
        assert not matches(json.dumps(doc)), doc


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "integer", "multipleOf": 3}, "'multipleOf'"), ({"type": "string", "format": "hostname"}, "'hostname'"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/b"}}}, "names no definition"),
    ({"type": "tuple"}, "type 'tuple'"), ({"type": "string", "pattern": "a("}, "missing )"),
    ({"type": "integer", "minimum": 5, "maximum": 4}, "no integer"), ({"oneOf": [{"type": "null"}]}, "'oneOf'"),
    ({"type": "number", "exclusiveMinimum": 1, "maximum": 1}, "no number"),
    ({"type": "string", "pattern": "^é$", "maxLength": 3}, "ASCII"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required names"), ("{not json", "not valid JSON"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, "derive no finite string"),
])
def test_unsupported_or_bad_schema_is_a_value_error_naming_it(schema, keyword):
    with pytest.raises(ValueError, match=re.escape(keyword)):
        Grammar(schema_to_grammar(schema))


@pytest.mark.parametrize("seed", range(4))
def test_token_mask_equals_a_brute_force_walk(seed):
    """allowed_tokens (the vectorised walk of lab token_mask) against walking each token's bytes
    one by one, in every state, on a random vocabulary that splits multi-byte characters."""
    rng = random.Random(seed)
    pieces = [c.encode() for c in "ab{}\":, 0123€é"] + ["€".encode()[:2], "€".encode()[2:], "é".encode()[:1]]
    vocab = [b""] + [b"".join(rng.choice(pieces) for _ in range(rng.randint(1, 4))) for _ in range(300)]
    dfa = compile_regex(r'\{(?:"a": "[^"\\]*"|"b": (?:1|"€é"))?\}')
    automaton = TokenAutomaton(dfa, TokenVocabulary(vocab, eos_token_id=0))
    for state in range(dfa.num_states):
        expected = [bool(b) and dfa.walk(state, b) != dfa.dead for b in vocab]
        direct = allowed_tokens(automaton.table, dfa.dead, state, automaton.vocab.sorted_bytes,
                                automaton.vocab.active, automaton.vocab.order)
        assert direct.tolist()[1:] == expected[1:], state
        expected[0] = dfa.accepting[state]                   # EOS: only where the output may end
        if any(expected):                                    # else this random vocabulary cannot go on
            assert automaton.mask(state).tolist() == expected, state


# ---- guided generation on the tiny random model (CharTokenizer: id i is chr(33 + i % 90)) -----

def tiny_llm(**kwargs):
    return LLM(model=random_model(tiny_config(), seed=0), tokenizer=CharTokenizer(), device="cpu",
               max_model_len=128, num_kv_blocks=32, **kwargs)


PROMPTS = [{"prompt_token_ids": [5, 9, 40, 7]}, {"prompt_token_ids": [60, 3]}, {"prompt_token_ids": [11] * 9}]


@pytest.mark.parametrize("guided, pattern", [
    (GuidedDecodingParams(regex="[a-f]{2,5}x(?:yz|q)"), "[a-f]{2,5}x(?:yz|q)"),
    (GuidedDecodingParams(choice=["KV", "cache!", "paged"]), "KV|cache!|paged"),
])
def test_guided_outputs_match_on_every_path(guided, pattern):
    llm = tiny_llm()
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=1, max_tokens=20, guided_decoding=guided)
        batched = llm.generate(PROMPTS, params, use_tqdm=False)             # the engine
        alone = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0]        # contiguous batch-1 path
        streamed = "".join(llm.stream(PROMPTS[0], params))                  # the engine, streamed
        for out in batched + [alone]:
            assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
            assert out.outputs[0].finish_reason == "stop"
        if temperature == 0:    # greedy over masked logits: the same on both runners
            assert alone.outputs[0].token_ids == batched[0].outputs[0].token_ids
            assert streamed == alone.outputs[0].text


def test_guided_greedy_is_the_argmax_of_the_masked_logits():
    """The engine precomputes one argmax for its greedy rows; a guided row beside free greedy rows
    must take the argmax of its MASKED logits, as the batch-1 path (which masks, then takes the
    argmax) does."""
    llm = tiny_llm()
    guided = SamplingParams(temperature=0, max_tokens=8, guided_decoding=GuidedDecodingParams(regex="[0-9]{4}"))
    free = SamplingParams(temperature=0, max_tokens=4)
    mixed = llm.generate(PROMPTS, [free, guided, free], use_tqdm=False)           # engine
    alone = llm.generate(PROMPTS[1:2], guided, use_tqdm=False)[0]                  # batch-1 path
    assert mixed[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert re.fullmatch("[0-9]{4}", alone.outputs[0].text)
    assert not all(re.fullmatch("[0-9]{4}", o.outputs[0].text) for o in (mixed[0], mixed[2]))   # the mask acted


NESTED = 'root ::= "[" item ("," item)* "]"\nitem ::= [0-9]+ | root'


def test_grammar_requests_share_steps_with_free_text_ones():
    """Free, grammar-guided and regex-guided rows in the same engine steps: each free row is
    token-for-token what it is alone (the masks touch only their own rows), each guided one is
    what it is alone and matches its grammar (a recursive one: nested lists)."""
    llm = tiny_llm()
    free = SamplingParams(temperature=0, max_tokens=12)
    nested = SamplingParams(temperature=0, max_tokens=40, guided_decoding=GuidedDecodingParams(grammar=NESTED))
    digits = SamplingParams(temperature=0, max_tokens=8, guided_decoding=GuidedDecodingParams(regex="[0-9]{4}"))
    prompts = PROMPTS + [{"prompt_token_ids": [7, 8, 9]}]
    params = [free, nested, free, digits]
    mixed = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, mixed):
        alone = llm.generate([prompt], p, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    text = mixed[1].outputs[0].text
    matcher = PushdownAutomaton(Grammar(NESTED), TokenVocabulary([b"x"], None))
    config = matcher.start
    for b in text.encode():
        config = matcher.step(config, b)
    assert config != matcher.dead and (mixed[1].outputs[0].finish_reason == "length" or matcher.is_accepting(config))
    assert re.fullmatch("[0-9]{4}", mixed[3].outputs[0].text)


def test_cut_by_max_tokens_is_a_valid_prefix():
    llm = tiny_llm()
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=5,
                            guided_decoding=GuidedDecodingParams(regex="(?:ab|cd){10}"))
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "length" and len(text) == 5
        dfa = compile_regex("(?:ab|cd){10}")
        assert dfa.walk(dfa.start, text.encode()) != dfa.dead          # a prefix of some match


def test_compiled_guides_are_cached_per_tokenizer():
    tok = CharTokenizer()
    a = compile_guide(GuidedDecodingParams(regex="ab+"), tok, 256)
    assert compile_guide(GuidedDecodingParams(regex="ab+"), tok, 256) is a
    assert compile_guide(GuidedDecodingParams(regex="ab+"), CharTokenizer(), 256) is not a
    state = GuideState(a)
    state.masked(torch.zeros(256))
    assert a.automaton.num_cached_states == 1           # the mask of a state is computed once
    state.masked(torch.zeros(256))
    assert a.automaton.num_cached_states == 1


def test_eos_only_in_accepting_states():
    guide = compile_guide(GuidedDecodingParams(regex="a+"), CharTokenizer(), 256)
    eos = CharTokenizer.eos_token_id
    state = GuideState(guide)
    assert not guide.automaton.mask(state.state)[eos]
    state.advance(ord("a") - 33)
    assert guide.automaton.mask(state.state)[eos]


@pytest.mark.parametrize("make, message", [
    (lambda: GuidedDecodingParams(), "exactly one"),
    (lambda: GuidedDecodingParams(regex="a", choice=["b"]), "exactly one"),
    (lambda: GuidedDecodingParams(choice=[]), "choice"),
    (lambda: SamplingParams(ignore_eos=True, guided_decoding=GuidedDecodingParams(regex="a")), "ignore_eos"),
    (lambda: SamplingParams(logprobs=1, guided_decoding=GuidedDecodingParams(regex="a", jump_forward=True)),
     "logprobs"),
])
def test_bad_guided_params_are_value_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_bad_constraint_fails_before_any_token():
    llm = tiny_llm()
    bad = SamplingParams(guided_decoding=GuidedDecodingParams(json={"type": "integer", "multipleOf": 3}))
    with pytest.raises(ValueError, match="'multipleOf'"):
        llm.generate(PROMPTS, [SamplingParams()] * 2 + [bad], use_tqdm=False)
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="jump_forward needs a tokenizer with encode"):
        llm.generate(PROMPTS, SamplingParams(guided_decoding=GuidedDecodingParams(regex="a", jump_forward=True)))


def test_a_grammar_the_vocabulary_cannot_spell_is_a_clear_error():
    """CharTokenizer has no space token: the request fails with a ValueError, and frees its blocks."""
    llm = tiny_llm()
    params = SamplingParams(max_tokens=4, guided_decoding=GuidedDecodingParams(regex="a b"))
    with pytest.raises(ValueError, match="no token of the vocabulary"):
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert llm.engine.block_manager.num_free_blocks == 32
