"""bench grammar's counting parts: on the corpus, minillm's grammar is right on every document and
xgrammar is wrong exactly where the pinned differences say (tests/guided/test_grammar_peer.py);
the timed loops check every token is allowed by both engines' masks before timing it."""
import pytest

xgr = pytest.importorskip("xgrammar")

from minillm.course.benchmarks import grammar  # noqa: E402
from minillm.course.benchmarks.schema_corpus import SCHEMAS  # noqa: E402
from minillm.guided.token_automaton import TokenVocabulary  # noqa: E402


@pytest.fixture(scope="module")
def compiler():
    return xgr.GrammarCompiler(xgr.TokenizerInfo([b"x"], vocab_size=1), max_threads=1, cache_enabled=False)


@pytest.mark.parametrize("name, xgrammar_all_right", [("measure", True), ("event", False), ("codes", False)])
def test_agreement_counts(compiler, name, xgrammar_all_right):
    row = grammar._agreement(compiler, SCHEMAS[name], seed=0)
    assert row["ours_right"] == row["documents"] > row["valid"] > 0
    assert (row["xgrammar_right"] == row["documents"]) == xgrammar_all_right
    assert row["agree"] == row["xgrammar_right"]            # ours is right everywhere: they agree where it is


def test_timed_loops_walk_real_documents():
    vocab = TokenVocabulary([bytes([b]) for b in range(256)] + [b""], eos_token_id=256)
    pda = grammar._ours(SCHEMAS["point"], vocab)
    docs = [[b for b in '{"xy": [1.5, -2]}'.encode()]]
    times = grammar._time_ours(pda, docs, clear_configs=True)
    assert len(times) == len(docs[0]) and all(t > 0 for t in times)
