"""Lab paged_blocks: the block pool on its own, and hashes that do not depend on the process."""
import subprocess
import sys

import pytest

import minillm.kvcache.prefix_cache as prefix_cache
from minillm.kvcache.block_manager import BlockPool, OutOfBlocks
from minillm.kvcache.prefix_cache import ROOT_HASH, PrefixCache, hash_block


def test_block_pool_counts_holders_and_recycles_blocks():
    pool = BlockPool(3)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2] and pool.num_free == 0
    with pytest.raises(OutOfBlocks):
        pool.allocate()
    pool.acquire(1)                                            # a fork: two holders
    assert pool.ref_counts == [1, 2, 1]
    pool.release(1)
    assert pool.num_free == 0                                  # still held once
    pool.release(1)
    pool.release(0)
    assert pool.ref_counts == [0, 0, 1] and pool.num_free == 2
    assert pool.free_block_ids() == [1, 0]                     # returned to the end, in order
    with pytest.raises(RuntimeError):
        pool.release(0)                                        # double free
    with pytest.raises(RuntimeError):
        pool.acquire(0)                                        # a free block holds nothing valid
    assert pool.allocate() == 1


def test_pool_evicts_only_when_no_free_block_is_left():
    cache = PrefixCache()
    pool = BlockPool(3, cache)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    for block, tokens in ((a, [1]), (b, [2])):
        cache.register(block, hash_block(ROOT_HASH, tokens), ROOT_HASH, tokens)
    pool.release(b)                                            # cached: stays findable, evictable
    pool.release(a)
    pool.release(c)                                            # not cached: plain free
    assert pool.num_free == 3 and cache.num_evictable == 2
    assert pool.allocate() == c                                # a never-cached block first
    assert pool.allocate() == b and not cache.is_cached(b)     # then the least recently released
    pool.acquire(a)                                            # a prefix hit revives a
    assert pool.ref_counts[a] == 1 and not cache.is_evictable(a) and cache.is_cached(a)
    with pytest.raises(OutOfBlocks):
        pool.allocate()


def test_hash_is_the_same_in_every_process():
    """Python's hash() of str and bytes is salted per process; a prefix must keep its name."""
    path = prefix_cache.__file__
    code = ("import importlib.util as u; s = u.spec_from_file_location('pc', %r); m = u.module_from_spec(s); "
            "s.loader.exec_module(m); print(m.chain_hashes(list(range(40)), 16))" % path)
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert outs == {str(prefix_cache.chain_hashes(list(range(40)), 16)) + "\n"}
    assert 0 <= hash_block(ROOT_HASH, [1, 2, 3]) < 2 ** 128
