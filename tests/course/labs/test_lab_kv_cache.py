"""Lab kv_cache: KVCache.write on its own (the rest of the lab is graded by tests/stages/test_kv_cache.py)."""
import torch

from minillm.model.llama import tiny_config
from minillm.stages.kv_cache import KVCache


def _kv(B, T, seed):
    cfg = tiny_config()
    g = torch.Generator().manual_seed(seed)
    shape = (B, cfg.n_kv_heads, T, cfg.head_dim)
    return cfg, torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def test_write_puts_each_token_at_its_position():
    cfg, k, v = _kv(B=2, T=3, seed=0)
    cache = KVCache(cfg, batch=2, max_len=8)
    positions = torch.tensor([[0, 1, 2], [4, 5, 6]])           # row 1 continues after 4 cached tokens
    cache.write(1, k, v, positions)
    assert torch.equal(cache.k[1, 0, :, 0:3], k[0]) and torch.equal(cache.v[1, 0, :, 0:3], v[0])
    assert torch.equal(cache.k[1, 1, :, 4:7], k[1]) and torch.equal(cache.v[1, 1, :, 4:7], v[1])


def test_write_overwrites_and_touches_nothing_else():
    cfg, k, v = _kv(B=2, T=2, seed=1)
    cache = KVCache(cfg, batch=2, max_len=6)
    cache.write(0, k, v, torch.tensor([[3, 1], [0, 5]]))       # positions need not be in order
    assert torch.equal(cache.k[0, 0, :, 3], k[0, :, 0]) and torch.equal(cache.k[0, 0, :, 1], k[0, :, 1])
    assert torch.equal(cache.v[0, 1, :, 5], v[1, :, 1]) and torch.equal(cache.v[0, 1, :, 0], v[1, :, 0])
    written = torch.zeros_like(cache.k, dtype=torch.bool)
    written[0, 0, :, [3, 1]] = True
    written[0, 1, :, [0, 5]] = True
    assert (cache.k[~written] == 0).all() and (cache.v[~written] == 0).all()   # other slots, layer 1
    _, k2, v2 = _kv(B=2, T=2, seed=2)
    cache.write(0, k2, v2, torch.tensor([[3, 1], [0, 5]]))     # a rewrite replaces, never adds
    assert torch.equal(cache.k[0, 0, :, 3], k2[0, :, 0]) and torch.equal(cache.v[0, 1, :, 5], v2[1, :, 1])
    assert cache.lengths.tolist() == [0, 0]                     # lengths are forward_cached's business
