"""ShortPrefixWatch (minillm/engine/worker.py): the /metrics signal for a shared prefix shorter than one KV block,
which the prefix cache (whole blocks only) can never reuse."""
from minillm.engine.worker import ShortPrefixWatch


def test_a_prefix_shared_below_one_block_is_reported_with_its_length():
    watch = ShortPrefixWatch(block_size=16)
    system = list(range(100, 110))                                   # a 10-token "system prompt"
    assert watch.observe(system + list(range(20))) == 0              # the first prompt shares nothing
    assert watch.observe(system + list(range(50, 70))) == 10         # 10 shared tokens: never a whole block


def test_a_whole_shared_block_or_chance_overlap_is_not_reported():
    watch = ShortPrefixWatch(block_size=16)
    watch.observe(list(range(40)))
    assert watch.observe(list(range(20)) + [999] * 10) == 0          # 20 shared tokens: the first block can hit
    assert watch.observe([0, 1, 2] + [7] * 30) == 0                  # 3 tokens: below MIN_SHARED, chance
    assert watch.observe(list(range(12))) == 0                       # a prompt of less than a block hits nothing anyway


def test_the_watch_forgets_the_oldest_prompts_past_its_capacity():
    watch = ShortPrefixWatch(block_size=16, capacity=2)
    watch.observe([1] * 8 + [2] * 20)
    watch.observe([3] * 30)
    watch.observe([4] * 30)                                          # the first prompt is forgotten
    assert watch.observe([1] * 8 + [5] * 20) == 0
    assert all(count > 0 for count in watch.prefixes.values()) and len(watch.kept) == 2
