"""Tree drafts (minillm/speculative/tree.py): the tree's attention mask and depths, greedy
verification along the argmax path, and multi-candidate rejection sampling that emits exactly the
target's distribution (chi-square, the project's statistical test), for deterministic candidates
and for candidates sampled from a draft distribution, at the first position and under an accepted
node."""
import pytest
import torch

from helpers import chi2_pvalue
from minillm.engine.sampling import SamplingParams, filtered_probs
from minillm.speculative.tree import DraftTree, verify_tree

V = 8


def test_mask_and_depths():
    tree = DraftTree()
    a = tree.add(3)
    b = tree.add(4)
    tree.add(5, a)
    tree.add(6, b)
    tree.add(7, 2)
    assert tree.depths() == [1, 1, 2, 2, 3]
    assert tree.ancestors().int().tolist() == [[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [1, 0, 1, 0, 0], [0, 1, 0, 1, 0],
                                               [1, 0, 1, 0, 1]]
    assert tree.children(-1) == [0, 1] and tree.children(2) == [4]
    with pytest.raises(ValueError, match="parent 9"):
        tree.add(1, 9)


def test_greedy_follows_the_argmax_path():
    tree = DraftTree()
    for t in (1, 2):
        tree.add(t)                     # nodes 0, 1 under the pending token
    tree.add(5, 1)                      # node 2 under node 1
    logits = torch.full((4, V), -5.0)
    logits[0, 2] = logits[2, 5] = logits[3, 6] = 1.0     # argmax: 2, then 5 (under node 1), then 6
    assert verify_tree(tree, logits, SamplingParams(temperature=0)) == ([2, 5, 6], [1, 2])
    logits[0, 2], logits[0, 7] = -5.0, 1.0               # argmax 7 is no child: emit it, accept nothing
    assert verify_tree(tree, logits, SamplingParams(temperature=0)) == ([7], [])


def softmax_rows(rows, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=gen) * 1.5


@pytest.mark.parametrize("sampled", [False, True])
def test_multi_candidate_rejection_sampling_emits_the_target_distribution(sampled):
    """Root with three candidates, the second of which has two children: the first emitted token
    follows p_root, and the token after an accepted second candidate follows that node's row."""
    params = SamplingParams(temperature=1.0)
    logits = softmax_rows(4, seed=1)                                   # rows: root, nodes 0, 1, 2
    draft = softmax_rows(2, seed=2)
    q_root, q_node = filtered_probs(draft[0], params), filtered_probs(draft[1], params)
    p_root, p_node = filtered_probs(logits[0], params), filtered_probs(logits[2], params)
    gen = torch.Generator().manual_seed(0)
    first = torch.zeros(V, dtype=torch.long)
    second = torch.zeros(V, dtype=torch.long)
    for _ in range(20_000):
        tree = DraftTree()
        if sampled:
            picks = torch.multinomial(q_root, 2, replacement=True, generator=gen).tolist()
            for t in picks:
                tree.add(t, -1, q_root)
            tree.add(int(torch.multinomial(q_node, 1, generator=gen)), 1, q_node)
        else:
            tree.add(0)
            tree.add(3)
            tree.add(4, 1)
        tokens, path = verify_tree(tree, logits, params, gen)
        first[tokens[0]] += 1
        if path[:1] == [1]:
            second[tokens[1]] += 1
    assert chi2_pvalue(first, p_root) > 0.01
    assert second.sum() > 500 and chi2_pvalue(second, p_node) > 0.01


def test_resampling_from_p_instead_of_the_residual_is_caught():
    """The classic bug, here for sampled candidates: after a rejection draw from p again, not from
    max(0, p - q). The same test rejects it."""
    import minillm.speculative.tree as tree_module

    params = SamplingParams(temperature=1.0)
    logits = softmax_rows(2, seed=3)                                   # root, and the one node
    q = filtered_probs(softmax_rows(1, seed=4)[0] * 3, params)
    p = filtered_probs(logits[0], params)
    gen = torch.Generator().manual_seed(0)

    def buggy(tree, children, p_row, generator):
        for c in children:
            if float(torch.rand((), generator=generator)) * float(tree.q[c][tree.tokens[c]]) < float(p_row[tree.tokens[c]]):
                return c, tree.tokens[c]
        return None, int(torch.multinomial(p_row, 1, generator=generator))

    original = tree_module._sample_children
    tree_module._sample_children = buggy
    try:
        counts = torch.zeros(V, dtype=torch.long)
        for _ in range(20_000):
            tree = DraftTree()
            tree.add(int(torch.multinomial(q, 1, generator=gen)), -1, q)
            counts[verify_tree(tree, logits, params, gen)[0][0]] += 1
    finally:
        tree_module._sample_children = original
    assert chi2_pvalue(counts, p) < 1e-6
