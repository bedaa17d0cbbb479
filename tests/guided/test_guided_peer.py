"""The token automaton against a well-kept peer, outlines-core's Index: on the same regex and the
same vocabulary (SmolLM2's tokens as bytes), the set of allowed tokens must be equal in every
state visited by random walks. Both compile the regex themselves (ours: minillm/guided/regex.py,
theirs: Rust's regex-automata), so this also checks our regex engine and UTF-8 handling.

JSON schemas go through our grammar engine, not a regex: its peer is xgrammar
(tests/guided/test_grammar_peer.py).

Where the two differ: outlines-core 0.2.14 drops tokens that continue a string which already
matched (after "a" for a(?:xb)?, the token "x", although "axb" matches; after "positive" for the
choice positive|positive!, the token "!"): its regex engine reports matches a byte late and
prefers the first alternative that matched. We keep them: the regex allows them. The corpus
below is therefore prefix-free (no match is a proper prefix of another, as every JSON object
is), where the sets must be exactly equal; the difference is pinned by its own test."""
import random

import pytest
import torch

outlines_core = pytest.importorskip("outlines_core")

from minillm import GuidedDecodingParams  # noqa: E402
from minillm.guided import guide_source  # noqa: E402
from minillm.guided.guide import compile_guide  # noqa: E402
from minillm.guided.token_automaton import vocabulary_bytes  # noqa: E402

CORPUS = [
    GuidedDecodingParams(regex=r"[0-9]{3}-[a-z]+(?:\.[a-z]{2,3})?;"),
    GuidedDecodingParams(regex="(?:héllo|€uro|日本)+ ?[^a-z\"!]{0,3}!"),
    GuidedDecodingParams(choice=["positive", "negative", "neutral", "mixed feelings"]),
    GuidedDecodingParams(regex=r'\{"name": "[^"\\]{0,8}"(?:, "age": -?(?:0|[1-9][0-9]*))?, "ok": (?:true|false)\}'),
]
WALKS, STEPS = 8, 30


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from minillm.loading.loader import load_model

    return load_model(str(smollm2_path), dtype="float32", device="cpu")[1]


@pytest.mark.parametrize("guided", CORPUS, ids=lambda g: str(g.regex or g.choice)[:30])
def test_allowed_tokens_equal_outlines_core_in_every_visited_state(tokenizer, guided):
    vocab_size = tokenizer.vocab_size
    token_bytes = vocabulary_bytes(tokenizer, vocab_size)
    eos = tokenizer.eos_token_id
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in enumerate(token_bytes):
        if b:
            by_bytes.setdefault(b, []).append(i)
    index = outlines_core.Index(guide_source(guided)[1], outlines_core.Vocabulary(eos, by_bytes))
    automaton = compile_guide(guided, tokenizer, vocab_size).automaton
    rng = random.Random(0)
    visited = set()
    for _ in range(WALKS):
        ours, theirs = automaton.dfa.start, index.get_initial_state()
        for _ in range(STEPS):
            mine = automaton.mask(ours)                                        # (V,) bool
            peer = torch.zeros(vocab_size, dtype=torch.bool)                   # (V,) bool
            peer[index.get_allowed_tokens(theirs)] = True
            assert torch.equal(mine, peer), (ours, (mine ^ peer).nonzero().flatten()[:10].tolist())
            visited.add(ours)
            token = rng.choice(mine.nonzero().flatten().tolist())
            if token == eos:
                break
            ours, theirs = automaton.next_state(ours, token), index.get_next_state(theirs, token)
    assert len(visited) > 3


@pytest.mark.slow            # the peer is imported at module level (tests/conftest.py)
def test_the_peer_drops_continuations_of_a_finished_match():
    """The difference the corpus above avoids, on a four-token vocabulary: after "a" the regex
    a(?:xb)? can go on to "axb"; after "positive", positive|positive! can go on to "positive!"."""
    from minillm.guided.regex import compile_regex
    from minillm.guided.token_automaton import TokenAutomaton, TokenVocabulary

    vocab = [b"a", b"x", b"b", b"positive", b"!", b""]
    for pattern, prefix, token in [("a(?:xb)?", b"a", 1), ("positive|positive!", b"positive", 4)]:
        index = outlines_core.Index(pattern, outlines_core.Vocabulary(5, {b: [i] for i, b in enumerate(vocab[:5])}))
        peer_state = index.get_next_state(index.get_initial_state(), vocab.index(prefix))
        assert index.get_allowed_tokens(peer_state) == [5]                      # EOS only
        dfa = compile_regex(pattern)
        ours = TokenAutomaton(dfa, TokenVocabulary(vocab, eos_token_id=5))
        allowed = ours.mask(dfa.walk(dfa.start, prefix))
        assert allowed[token] and allowed[5] and allowed.sum() == 2              # the continuation and EOS
        assert dfa.matches((prefix + vocab[token]).decode() + ("b" if token == 1 else ""))
