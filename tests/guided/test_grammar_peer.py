"""The grammar engine against a well-kept peer, xgrammar: on the same grammar text (our GBNF,
which xgrammar reads too) and SmolLM2's vocabulary, the allowed tokens are equal in every
configuration that random walks visit; on the schema corpus, whole documents are accepted alike
except where the judge (jsonschema) shows xgrammar 0.2.9 wrong, each such difference pinned by
its own test: it accepts calendar dates that do not exist, refuses escapes in a length-bounded
string and anchors an unanchored pattern. One mask difference is xgrammar's own inconsistency:
its mask leaves out a token that closes two nested rules at once ("]]" after "[["), which its
accept_token then accepts; every mask difference is checked to be of that kind."""
import json
import random

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from minillm.course.benchmarks.schema_corpus import SCHEMAS, documents  # noqa: E402
from minillm.guided.grammar import Grammar  # noqa: E402
from minillm.guided.json_schema import schema_to_grammar  # noqa: E402
from minillm.guided.pushdown import PushdownAutomaton  # noqa: E402
from minillm.guided.token_automaton import TokenVocabulary, vocabulary_bytes  # noqa: E402

GRAMMARS = [
    'root ::= "[" (item (", " item)*)? "]"\nitem ::= [0-9]+ | "\\"" [a-z ]* "\\"" | root',
    schema_to_grammar({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}}, "required": ["name"],
        "additionalProperties": False}),
    schema_to_grammar({"type": "object", "properties": {"when": {"type": "string", "format": "date"},
                                                       "score": {"type": "number", "minimum": -1.5, "maximum": 2}},
                       "required": ["when", "score"], "additionalProperties": False}),
]
WALKS, STEPS = 10, 40


@pytest.fixture(scope="module")
def vocab(smollm2_path):
    from minillm.loading.loader import load_model

    tok = load_model(str(smollm2_path), dtype="float32", device="cpu")[1]
    token_bytes = vocabulary_bytes(tok, tok.vocab_size)
    info = xgr.TokenizerInfo(token_bytes, vocab_type=xgr.VocabType.RAW, vocab_size=tok.vocab_size,
                             stop_token_ids=[tok.eos_token_id])
    return TokenVocabulary(token_bytes, tok.eos_token_id), info


@pytest.mark.parametrize("text", GRAMMARS, ids=["lists", "recursive-schema", "date-and-range"])
def test_allowed_tokens_equal_xgrammar_in_every_visited_configuration(vocab, text):
    ours_vocab, info = vocab
    pda = PushdownAutomaton(Grammar(text), ours_vocab)
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_grammar(xgr.Grammar.from_ebnf(text))
    bitmask = xgr.allocate_token_bitmask(1, len(ours_vocab.token_bytes))
    rng = random.Random(0)
    visited = set()
    for _ in range(WALKS):
        config, matcher = pda.start, xgr.GrammarMatcher(compiled)
        for _ in range(STEPS):
            mine = pda.mask(config)                                                  # (V,) bool
            matcher.fill_next_token_bitmask(bitmask)
            bits = bitmask[0].view(torch.uint8).unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)  # (V/8, 8)
            theirs = (bits & 1).flatten().bool()[:len(mine)]                        # (V,) bool, little-endian
            for t in (mine ^ theirs).nonzero().flatten().tolist():      # only where the peer contradicts itself
                assert mine[t] and not theirs[t] and matcher.fork().accept_token(t), (config, t)
            visited.add(config)
            token = rng.choice(mine.nonzero().flatten().tolist())
            if token == ours_vocab.eos_token_id:
                break
            config = pda.next_state(config, token)
            assert matcher.accept_token(token)
    assert len(visited) > 15


def test_the_peer_mask_leaves_out_a_token_its_matcher_accepts():
    text = GRAMMARS[0]
    info = xgr.TokenizerInfo([b"[", b"]", b"]]"], vocab_size=3)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(xgr.Grammar.from_ebnf(text)))
    assert matcher.accept_token(0) and matcher.accept_token(0)                   # "[["
    bitmask = xgr.allocate_token_bitmask(1, 3)
    matcher.fill_next_token_bitmask(bitmask)
    assert int(bitmask[0, 0]) & 0b111 == 0b011                                   # "]]" left out of the mask
    assert matcher.fork().accept_token(2)                                        # ... yet accepted
    pda = PushdownAutomaton(Grammar(text), TokenVocabulary([b"[", b"]", b"]]"], None))
    assert pda.mask(pda.next_state(pda.next_state(pda.start, 0), 0)).tolist() == [True, True, True]


def _accepts(schema):
    pda = PushdownAutomaton(Grammar(schema_to_grammar(schema)), TokenVocabulary([b"x"], None))
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([b"x"], vocab_size=1)).compile_json_schema(
        json.dumps(schema), any_whitespace=False, separators=(", ", ": "))

    def both(text):
        config = pda.start
        for b in text.encode():
            config = pda.step(config, b)
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return pda.is_accepting(config), matcher.accept_string(text) and matcher.is_completed()
    return both


@pytest.mark.parametrize("name", ["expression", "point", "measure", "inventory", "matrix", "status", "anything"])
def test_whole_documents_accepted_alike_on_the_corpus(name):
    both = _accepts(SCHEMAS[name])
    docs = documents(SCHEMAS[name], seed=0)
    for text, valid in docs:
        assert both(text) == (valid, valid), text
    assert 0 < sum(v for _, v in docs) < len(docs)


def test_the_peer_accepts_dates_that_do_not_exist():
    both = _accepts({"type": "string", "format": "date"})
    assert both('"2023-02-29"') == (False, True) and both('"2024-02-29"') == (True, True)


def test_the_peer_refuses_escapes_in_a_length_bounded_string():
    both = _accepts({"type": "string", "maxLength": 8})
    assert both(json.dumps('a"b')) == (True, False) and both(json.dumps("ab")) == (True, True)


def test_the_peer_anchors_an_unanchored_pattern():
    both = _accepts({"type": "string", "pattern": "ok"})           # JSON schema patterns match anywhere
    assert both('"look"') == (True, False) and both('"ok"') == (True, True)
