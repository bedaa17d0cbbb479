"""Paged-attention Triton kernels against the gather-based PyTorch reference.

On a machine without CUDA the kernels run under TRITON_INTERPRET=1 (set below before the kernel
module is imported: triton decides compile vs interpret at decoration time). With CUDA the same
tests run the compiled kernels on the GPU.

Shapes follow vLLM's paged-attention tests: random permuted block tables (a sequence's pages are
scattered over the pool), context lengths 1, 37, 463, 1328, GQA ratios 1, 3, 4, 5, page sizes
1 and 16. Tolerances: fp32 1e-5; fp16/bf16 atol 1.5e-2, rtol 1e-2 against the fp32 reference on
the same rounded inputs (vLLM's bound). Interpreter note: tl.dot on bf16 is wrong under
TRITON_INTERPRET=1 (triton #11584), so on CPU the kernel upcasts bf16 tiles to fp32 before each
dot; only a CUDA run tests native bf16 dots.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.paged_attention import paged_attention_decode, store_kv  # noqa: E402
from minillm.attention.paged import (  # noqa: E402
                                     allocate_kv_cache, block_table_tensor, paged_attention_reference, store_kv_reference,
                                     )

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENGTHS = [1, 37, 463, 1328]
HEAD_DIM = 16                    # small: the interpreter's cost grows with every element


def scattered_cache(lengths, num_kv_heads, head_dim, block_size, dtype=torch.float32, seed=0,
                    spare_blocks=7):
    """A pool holding each sequence's K/V in randomly permuted pages, plus the same K/V contiguous.

    Returns k_cache, v_cache, block_tables (B, max_blocks) int32, seq_lens (B,) int32 and the
    list of contiguous (L, Hkv, D) K and V per sequence that the pages hold.
    """
    gen_kv = torch.Generator().manual_seed(seed)                     # the content: same for any page size
    kv = [(torch.randn(n, num_kv_heads, head_dim, generator=gen_kv),  # K (L, Hkv, D)
           torch.randn(n, num_kv_heads, head_dim, generator=gen_kv))  # V (L, Hkv, D)
          for n in lengths]
    gen = torch.Generator().manual_seed(seed + 1)                    # the layout
    per_seq = [-(-n // block_size) for n in lengths]
    num_blocks = sum(per_seq) + spare_blocks
    k_cache, v_cache = allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim)
    k_cache.normal_(generator=gen)                                   # garbage outside the tables
    v_cache.normal_(generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for (k, v), nb in zip(kv, per_seq):
        table, order = order[:nb], order[nb:]
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(len(k))],
                             dtype=torch.long)
        store_kv_reference(k, v, k_cache, v_cache, slots)
        tables.append(table)
    k_cache, v_cache = k_cache.to(DEVICE, dtype), v_cache.to(DEVICE, dtype)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    return k_cache, v_cache, block_table_tensor(tables, DEVICE), seq_lens, kv


def make_q(batch, num_heads, head_dim, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, num_heads, head_dim, generator=gen).to(DEVICE, dtype)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("group", [1, 3, 4, 5])
def test_kernel_matches_reference_and_split(group, block_size):
    num_kv_heads = 2
    k_cache, v_cache, tables, seq_lens, _ = scattered_cache(LENGTHS, num_kv_heads, HEAD_DIM, block_size)
    q = make_q(len(LENGTHS), num_kv_heads * group, HEAD_DIM)
    ref = paged_attention_reference(q, k_cache, v_cache, tables, seq_lens, HEAD_DIM ** -0.5)
    out = paged_attention_decode(q, k_cache, v_cache, tables, seq_lens)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    out_split = paged_attention_decode(q, k_cache, v_cache, tables, seq_lens, num_splits=5)
    torch.testing.assert_close(out_split, out, atol=1e-6, rtol=1e-5)


def test_block_sizes_1_and_16_give_the_same_output():
    """The same logical K/V in pages of 1 and of 16 tokens: the kernel walks positions, not
    pages, so the arithmetic is identical and the outputs are bit-for-bit equal."""
    outs = []
    for block_size in (1, 16):
        k_cache, v_cache, tables, seq_lens, _ = scattered_cache(LENGTHS, 1, HEAD_DIM, block_size, seed=3)
        q = make_q(len(LENGTHS), 4, HEAD_DIM)
        outs.append(paged_attention_decode(q, k_cache, v_cache, tables, seq_lens, num_splits=3))
    assert torch.equal(outs[0], outs[1])


def test_reference_matches_contiguous_attention():
    """The gather-based reference is itself checked against SDPA on the contiguous K/V."""
    k_cache, v_cache, tables, seq_lens, kv = scattered_cache([5, 37, 70], 2, HEAD_DIM, 16)
    q = make_q(3, 6, HEAD_DIM)
    ref = paged_attention_reference(q, k_cache, v_cache, tables, seq_lens, HEAD_DIM ** -0.5)
    for b, (k, v) in enumerate(kv):
        k = k.to(DEVICE).repeat_interleave(3, dim=1).transpose(0, 1)             # (Hq, L, D)
        v = v.to(DEVICE).repeat_interleave(3, dim=1).transpose(0, 1)             # (Hq, L, D)
        o = torch.nn.functional.scaled_dot_product_attention(q[b][:, None], k, v)  # (Hq, 1, D)
        torch.testing.assert_close(ref[b], o[:, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision(dtype):
    k_cache, v_cache, tables, seq_lens, _ = scattered_cache([1, 37, 463], 2, 64, 16, dtype=dtype)
    q = make_q(3, 8, 64, dtype=dtype)
    ref = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), tables, seq_lens, 64 ** -0.5)
    for num_splits in (1, 4):
        out = paged_attention_decode(q, k_cache, v_cache, tables, seq_lens, num_splits=num_splits)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), ref, atol=1.5e-2, rtol=1e-2)


def test_more_splits_than_tiles_and_empty_sequences():
    """Segments past the end of a short sequence are empty (weight 0 in the merge); a sequence of
    length 0 (a padding row of the batch) gives zeros, split or not."""
    k_cache, v_cache, tables, seq_lens, _ = scattered_cache([3, 0, 20], 1, HEAD_DIM, 16)
    q = make_q(3, 2, HEAD_DIM)
    ref = paged_attention_reference(q, k_cache, v_cache, tables, seq_lens, 0.3)
    assert torch.equal(ref[1], torch.zeros_like(ref[1]))
    for num_splits in (1, 8):
        out = paged_attention_decode(q, k_cache, v_cache, tables, seq_lens, sm_scale=0.3, num_splits=num_splits)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_reference(dtype):
    """Store through a slot mapping with padding (-1), from K/V that are strided views of a
    fused QKV projection (as the model produces them)."""
    gen = torch.Generator().manual_seed(0)
    T, Hkv, D, block_size, num_blocks = 9, 3, 24, 4, 6
    qkv = torch.randn(T, 5 * Hkv, D, generator=gen).to(DEVICE, dtype)          # (T, 5*Hkv, D)
    k, v = qkv[:, 3 * Hkv:4 * Hkv], qkv[:, 4 * Hkv:]                             # (T, Hkv, D) views
    slots = torch.cat([torch.tensor([0]), 1 + torch.randperm(num_blocks * block_size - 1, generator=gen)[:T - 1]])
    slots[[2, 7]] = -1
    k_cache, v_cache = allocate_kv_cache(num_blocks, block_size, Hkv, D, dtype, DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(k, v, k_cache, v_cache, slots.to(DEVICE))
    store_kv_reference(k, v, k_ref, v_ref, slots.to(DEVICE))
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert k_cache.flatten(0, 1).abs().sum((1, 2)).count_nonzero() == T - 2      # padding not written


def test_bad_arguments():
    k_cache, v_cache, tables, seq_lens, _ = scattered_cache([5], 2, HEAD_DIM, 16)
    q = make_q(1, 4, HEAD_DIM)
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention_decode(q, k_cache, v_cache, tables, seq_lens, num_splits=0)
    with pytest.raises(ValueError, match="block_n"):
        paged_attention_decode(q, k_cache, v_cache, tables, seq_lens, block_n=24)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_attention_decode(make_q(1, 3, HEAD_DIM), k_cache, v_cache, tables, seq_lens)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_attention_decode(q, k_cache, v_cache, tables, seq_lens.repeat(2))
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(q[0, :2, None].expand(2, 2, HEAD_DIM), q[0, :2, None].expand(2, 2, HEAD_DIM),
                 k_cache, v_cache, torch.tensor([0], device=DEVICE))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU with ~10 GB free")
def test_block_ids_past_int32_offsets():
    """A pool so large that block_id * block_stride overflows int32: offsets must be int64."""
    block_size, Hkv, D = 16, 8, 128
    num_blocks = 2 ** 31 // (block_size * Hkv * D) + 64                          # ~4.3 GB per cache in bf16
    k_cache, v_cache = allocate_kv_cache(num_blocks, block_size, Hkv, D, torch.bfloat16, DEVICE)
    top = list(range(num_blocks - 40, num_blocks))                               # only the last pages
    gen = torch.Generator().manual_seed(0)
    k_cache[top] = torch.randn(40, block_size, Hkv, D, generator=gen).to(DEVICE, torch.bfloat16)
    v_cache[top] = torch.randn(40, block_size, Hkv, D, generator=gen).to(DEVICE, torch.bfloat16)
    tables = block_table_tensor([top[::-1]], DEVICE)
    seq_lens = torch.tensor([40 * block_size - 3], dtype=torch.int32, device=DEVICE)
    q = make_q(1, 4 * Hkv, D, torch.bfloat16)
    ref = paged_attention_reference(q.float(), k_cache, v_cache, tables, seq_lens, D ** -0.5)
    for num_splits in (1, 4):
        out = paged_attention_decode(q, k_cache, v_cache, tables, seq_lens, num_splits=num_splits)
        torch.testing.assert_close(out.float(), ref.float(), atol=1.5e-2, rtol=1e-2)
