"""bench eagle-engine's choice of the static draft tree: the nodes most often right, each only after its parent."""
from minillm.course.benchmarks.eagle_engine import CANDIDATES, best_tree
from minillm.speculative.tree import tree_paths


def test_the_tree_takes_the_most_often_right_nodes_in_tree_order():
    share = dict.fromkeys(CANDIDATES, 0.0)
    share.update({(0,): 0.4, (1,): 0.1, (0, 0): 0.2, (0, 0, 0): 0.15, (1, 0): 0.3, (2,): 0.05})
    assert best_tree(share, 3) == ((0,), (0, 0), (0, 0, 0))     # (1, 0) is likelier, but (1,) comes first
    assert best_tree(share, 5) == ((0,), (1,), (0, 0), (1, 0), (0, 0, 0))
    assert tree_paths(best_tree(share, 7), 7) == best_tree(share, 7)   # a valid tree, in topological order


def test_the_candidates_are_a_tree_in_topological_order():
    assert tree_paths(CANDIDATES, len(CANDIDATES)) == CANDIDATES
