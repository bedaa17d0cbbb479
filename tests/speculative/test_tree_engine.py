"""Tree drafts in the runner: one small step verifies a pending token and a tree of drafts (build_batch's run tree:
each row at its depth's position, attending to the context and its own ancestors), every node getting the logits
of its own path; the accepted path, moved to the slots after the pending token (PagedKVCache.move_slots), is then
the cache plain decoding would have written. fp32, against the plain model over each whole sequence."""
import pytest
import torch

from helpers import CharTokenizer
from minillm import LLM
from minillm.model import cpu_gemm
from minillm.model.llama import random_model, tiny_config
from minillm.model.runner import build_batch, run_tree

pytestmark = pytest.mark.skipif(cpu_gemm.kernel()[0] is None, reason=f"no C kernel here: {cpu_gemm.kernel()[1]}")

PARENTS = [-1, 0, 0, 1, 1, 2, 3, 6]          # the run's rows: 0 the pending token, 1-7 a tree of seven drafts


@pytest.fixture(scope="module")
def setup():
    model = random_model(tiny_config(), seed=3)
    llm = LLM(model=model, tokenizer=CharTokenizer(), max_model_len=128, tune_kernels=False)
    return model, llm.engine.runner


def slots_of(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def run(runner, tokens, start, table, parents=None, want="all"):
    bs = runner.kv.block_size
    batch = build_batch([(tokens, start, table, slots_of(table, start, start + len(tokens), bs), parents)], [want],
                        bs, "cpu", None)
    return runner.forward(batch)


def path_tokens(tokens: list[int], parents: list[int], row: int) -> list[int]:
    """The run's tokens from row 0 down to `row`."""
    out = []
    while row >= 0:
        out.append(tokens[row])
        row = parents[row]
    return out[::-1]


def test_run_tree_depths_and_masks():
    depths, masks = run_tree(PARENTS)
    assert depths == [0, 1, 1, 2, 2, 2, 3, 4]
    assert masks[6] == 0b1001011 and masks[7] == 0b11001011           # rows 0, 1, 3, 6 (and 7)
    assert run_tree([-1, 0, 1]) == ([0, 1, 2], [1, 3, 7])              # a chain is the causal run
    with pytest.raises(ValueError, match="row 2's parent is 2"):
        run_tree([-1, 0, 2])


def test_one_small_step_gives_every_node_the_logits_of_its_own_path(setup):
    model, runner = setup
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (21,), generator=g).tolist()
    tree = torch.randint(0, 256, (8,), generator=g).tolist()            # the pending token and seven drafts
    table = [5, 2, 7]
    run(runner, prompt, 0, table, want="last")
    before = runner.compiled_decode_steps
    logits = run(runner, tree, len(prompt), table, PARENTS)             # (8, V)
    assert runner.compiled_decode_steps == before + 1                   # one small step took the whole tree
    with torch.no_grad():
        for row in range(len(tree)):
            want = model(torch.tensor([prompt + path_tokens(tree, PARENTS, row)]))[0, -1]
            torch.testing.assert_close(logits[row], want, atol=1e-4, rtol=1e-4)


def test_the_accepted_path_moved_after_the_pending_token_decodes_like_plain(setup):
    model, runner = setup
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (13,), generator=g).tolist()         # the tree crosses a block boundary
    tree = torch.randint(0, 256, (8,), generator=g).tolist()
    table, n, bs = [3, 9, 4], len(prompt), runner.kv.block_size
    run(runner, prompt, 0, table, want="last")
    run(runner, tree, n, table, PARENTS)
    rows = [0, 1, 3, 6, 7]                                              # an accepted path through rank-2 nodes
    slots = slots_of(table, n, n + 8, bs)
    runner.kv.move_slots([slots[r] for r in rows[1:]], slots[1:len(rows)])
    nxt = 42
    got = run(runner, [nxt], n + len(rows), table, want="last")[0]
    with torch.no_grad():
        want = model(torch.tensor([prompt + path_tokens(tree, PARENTS, 7) + [nxt]]))[0, -1]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_tree_outside_a_small_step_is_refused(setup):
    _, runner = setup
    bs = runner.kv.block_size
    runs = [([1] * 8, 0, [1], slots_of([1], 0, 8, bs), PARENTS), ([2], 0, [2], slots_of([2], 0, 1, bs))]
    with pytest.raises(ValueError, match="tree drafts need a small step"):
        build_batch(runs, ["all", "last"], bs, "cpu", None)


def test_a_runner_whose_small_step_cannot_take_the_tree_refuses_it(setup, monkeypatch):
    """Where the small step takes fewer rows (the few-row kernel not built), no other path reads a tree's masks:
    the runner says so instead of attending causally."""
    _, runner = setup
    monkeypatch.setattr(runner, "small_step_rows", 1)
    assert runner.tree_rows == 1
    with pytest.raises(ValueError, match="takes trees in steps of at most 1 rows"):
        run(runner, list(range(8)), 0, [6], PARENTS)
