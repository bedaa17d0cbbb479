"""The engine's Llama decoder layer, written once.

    h = decoder_layer(h, weights, cos, sin, attention, n_heads, n_kv_heads, eps)     # (N, dim) -> (N, dim)

N rows are the step's new tokens, back to back, whatever requests they belong to (model/runner.py
builds that flat batch). Only `attention` knows where one request ends and the next begins: it
receives q, k, v of every row, stores k and v in the paged cache and returns each row's output.

What differs between the ways the engine runs this layer is data, not code:
- `weights` per layer: (attn_norm, qkv, wo, ffn_norm, gate_up, down, qk_norm). A projection is a tensor
  (out, in), a packed int8/int4 tuple (quant/cpu_kernels.fused_pack), or any callable x -> y
  (an nn.Linear, a prepacked GEMM, a tensor-parallel linear that all-reduces, three quantised
  linears side by side). `project` applies whichever it is. q, k, v come from ONE matrix and
  gate, up from ONE: fused once, at load time (transforms.fuse_projections). qk_norm: None, or
  the (q_norm, k_norm) weights (D,) of a model that RMS-normalises each head of q and k (Qwen3).
  DeepSeek's two changes are data too: an MLA layer's qkv is a mla.LatentProjections (q, k, v over the
  latent cache, and the latent outputs mapped to the heads' values afterwards); a mixture-of-experts
  layer's gate_up is the whole MLP (a moe.MoE: route, run the chosen experts, add) and its down is None.
- `attention`: a closure over the step's attention metadata (model/runner.py).
- compiled or not, on CPU: a small step (up to 8 rows: decode tokens, a speculative verification, a
  short prompt) runs this same function under torch.compile with its attention inside
  (compiled_decode_layer below: each layer becomes a few generated loops and, for 2 or more rows, calls
  of the few-row GEMM kernel, model/cpu_gemm.c); a step of more rows runs it under torch.compile too,
  with the attention call left out of the graph (compiled_layer: the pieces between attention calls
  are compiled, vLLM's piecewise compilation; attention runs as its backend wrote it), except a step of
  decode tokens only with the C decode kernel, which runs it with that kernel's op inside one graph per
  layer (compiled_decode_only_layer, NEW). The eager run is op by op.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from .mla import LatentProjections
from .positions import apply_rope


def compiler_errors() -> tuple[type[BaseException], ...]:
    """What torch.compile raises when IT fails (tracing, lowering, building the C++), as opposed to
    an error of the code it runs. Looked up by name: the classes move between torch versions
    (InductorError is 2.7+); TorchDynamoException covers BackendCompilerFailed, Unsupported,
    TorchRuntimeError and InternalTorchDynamoError."""
    import torch._dynamo.exc as dynamo_exc
    import torch._inductor.exc as inductor_exc

    found = [getattr(dynamo_exc, "TorchDynamoException", None)]
    found += [getattr(inductor_exc, name, None)
              for name in ("InductorError", "LoweringException", "CppCompileError", "InvalidCxxCompiler")]
    return tuple(e for e in found if e is not None)


class compile_on_first_call:
    """torch.compile(fn, **options), built when first called. torch.compile imports the compiler
    (Dynamo, Inductor, sympy), most of `import minillm`'s time, which every CLI call, server, worker
    and notebook would otherwise pay whether it compiles or not.
    fallback: what runs instead where Inductor refuses `options` (an option it does not have)."""

    def __init__(self, fn, fallback=None, **options):
        self.fn, self.options, self.fallback, self.compiled = fn, options, fallback, None

    def __call__(self, *args, **kwargs):
        if self.compiled is None:
            try:
                self.compiled = torch.compile(self.fn, **self.options)
            except RuntimeError:                  # torch.compile checks the options when it builds the wrapper
                if self.fallback is None:
                    raise
                self.compiled = self.fallback
        return self.compiled(*args, **kwargs)


def compiled_or_eager(owner, compiled, eager, *args):
    """compiled(*args); where torch.compile cannot build (no C++ compiler), warn once, record why in
    owner.compile_failed and run eager(*args), the same math unfused, from then on (the owner: a
    ModelRunner or a FastDecoder, each with its own record)."""
    if owner.compile_failed is None:
        try:
            return compiled(*args)
        except compiler_errors() as e:                                   # any other error is the step's own
            owner.compile_failed = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
            warnings.warn(f"torch.compile could not build the CPU decode kernels ({owner.compile_failed}); "
                          "running them eagerly")
    return eager(*args)


def rowwise_dot(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """weight (out, in), x (in,) -> (out,) in weight's dtype, summed in fp32. Written elementwise
    then reduced so that Inductor generates one vectorised loop that reads each weight once (a
    matmul would be handed to the BLAS GEMV, slower for these shapes on the CPUs of lesson 02).
    Compiled use only: run eagerly it materialises weight * x."""
    return (weight.float() * x.float()).sum(-1).to(weight.dtype)


def blocked_dot(blocks: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """blocks (out/R, in, R): a weight (out, in) laid out in blocks of R rows (transforms.gemv_blocks),
    x (in,) -> (out,) in the weights' dtype, summed in fp32. Inductor vectorises over the R rows of a
    block and walks down `in`: each iteration reads one contiguous run of R weights and adds it,
    times x[i], to R running sums held in vector registers, with no horizontal sum per row; and
    anything fused into x (the RMSNorm before a projection) is computed once per block of R rows,
    not once per row as in rowwise_dot. Compiled use only, like rowwise_dot."""
    return (blocks.float() * x.float()[None, :, None]).sum(1).flatten().to(blocks.dtype)


def gemv(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """w @ x for x (in,) -> (out,): w (out, in) by the row-wise dot, or in blocks (out/R, in, R) by
    blocked_dot; run eagerly (where compiling failed), by the library's kernels instead, which do
    not materialise w * x."""
    if not torch.compiler.is_compiling():
        return torch.mv(w, x) if w.dim() == 2 else torch.einsum("bir,i->br", w, x).flatten()
    return blocked_dot(w, x) if w.dim() == 3 else rowwise_dot(w, x)


def project(w, x: torch.Tensor) -> torch.Tensor:
    """x (N, in) -> (N, out) by the projection w: a tensor (out, in) or its row blocks (out/R, in, R)
    (one row: gemv, compiled use only; more: a matmul), a packed int8/int4 tuple (its CPU kernel),
    or a callable."""
    if isinstance(w, torch.Tensor):
        if x.shape[0] == 1:
            return gemv(w, x[0])[None]
        return x @ w.t() if w.dim() == 2 else torch.einsum("ni,bir->nbr", x, w).flatten(1)
    if isinstance(w, tuple):
        from minillm.quant.cpu_kernels import packed_mm
        return packed_mm(x, *w)
    return w(x)


def decoder_layer(h: torch.Tensor, weights: tuple, rope, attention, n_heads: int, n_kv_heads: int,
                  eps: float) -> torch.Tensor:
    """h (N, dim) -> (N, dim): pre-norm attention then a SwiGLU MLP, each added to the residual.
    rope(x) rotates x (N, H, D) by each row's position (RoPE; positions.apply_rope_complex eagerly,
    positions.apply_rope under torch.compile, which generates no complex arithmetic);
    attention(q, k, v) -> (N, Hq, D) with q (N, Hq, D) and k (N, Hkv, D) rotated, v (N, Hkv, D)."""
    attn_norm, qkv, wo, ffn_norm, gate_up, down, qk_norm = weights
    N = h.shape[0]
    Hq, Hkv = n_heads, n_kv_heads
    x = F.rms_norm(h, attn_norm.shape, attn_norm, eps)                           # (N, dim)
    if isinstance(qkv, LatentProjections):                                       # MLA: over the latent cache
        out = qkv.values(attention(*qkv(x, rope)))                               # (N, H, d_v)
    else:
        qkv_out = project(qkv, x)                                                # (N, (Hq+2Hkv)*D)
        D = qkv_out.shape[-1] // (Hq + 2 * Hkv)
        qk, v = qkv_out.split([(Hq + Hkv) * D, Hkv * D], dim=-1)
        qk = qk.view(N, Hq + Hkv, D)                                             # (N, Hq+Hkv, D): q, k together
        if qk_norm is not None:                                                  # each head RMS-normalised
            q_norm, k_norm = qk_norm
            qk = torch.cat([F.rms_norm(qk[:, :Hq], (D,), q_norm, eps), F.rms_norm(qk[:, Hq:], (D,), k_norm, eps)], 1)
        qk = rope(qk)
        out = attention(qk[:, :Hq], qk[:, Hq:], v.view(N, Hkv, D))               # (N, Hq, D)
    h = h + project(wo, out.flatten(1))                                      # (N, Hq*D) -> (N, dim)
    x = F.rms_norm(h, ffn_norm.shape, ffn_norm, eps)
    if down is None:                                                             # a mixture of experts (model/moe.py)
        return h + gate_up(x)
    gate, up = project(gate_up, x).chunk(2, dim=-1)                              # (N, ffn) each
    return h + project(down, F.silu(gate) * up)


def paged_decode_layer(h: torch.Tensor, weights: tuple, cos: torch.Tensor, sin: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor, n_heads: int, n_kv_heads: int,
                       eps: float, window: int | None = None, runs: tuple | None = None,
                       attend=None) -> torch.Tensor:
    """decoder_layer for a small step, every row a query of its own (a decode token, or one token of a short
    run such as a speculative verification), with RoPE by cos, sin (N, 1, D/2) and its attention spelled out
    for torch.compile: each row's k, v written at its slot, then each row attends to its blocks' keys up to
    its own position, read in place. k_cache, v_cache (num_blocks, block_size, Hkv, D): this layer's cache;
    slots (N,), block_tables (N, n), seq_lens (N,) (position + 1); window: the model's sliding window
    (None: full attention); runs: None, or for a tree of drafts (NEW) (run_starts, run_masks) (N,) int64 each:
    the keys of its run a row sees (its ancestors' and its own). The attention: attend(q, k_cache, v_cache,
    block_tables, seq_lens, window) where given (decode_only_layer: the C kernel's op, no tree), else
    attention.paged.decode_attention_fused: loops Inductor generates, in the graph."""
    from minillm.attention.paged import decode_attention_fused

    def attention(q, k, v):
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))   # (blocks*bs, Hkv, D)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))
        if attend is not None:
            return attend(q.contiguous(), k_cache, v_cache, block_tables, seq_lens, window)
        return decode_attention_fused(q.contiguous(), k_cache, v_cache, block_tables, seq_lens, window, runs)

    return decoder_layer(h, weights, lambda x: apply_rope(x, cos, sin), attention, n_heads, n_kv_heads, eps)


def decode_only_layer(h: torch.Tensor, weights: tuple, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      n_heads: int, n_kv_heads: int, eps: float, window: int | None = None) -> torch.Tensor:
    """NEW: one graph per layer: paged_decode_layer for a step of decode tokens only, more rows than the small step
    takes, with the engine's projections (prepacked GEMMs) and the C decode kernel's op (attention/cpu_decode.c) as
    its attention, block_tables (N, n) and seq_lens (N,) int32 as the kernel takes them. A function of its own
    only so that its graphs count against a recompile limit of their own (Dynamo counts per code object)."""
    from minillm.attention.cpu_decode import decode_attention_op

    return paged_decode_layer(h, weights, cos, sin, k_cache, v_cache, slots, block_tables, seq_lens, n_heads,
                              n_kv_heads, eps, window, attend=decode_attention_op)


# One compiled function serves every layer (all have the same shapes) and every step: the blocks per
# row and the KV pool's block count are symbolic (the runner marks them), the rest are constants of
# the loops. dynamic=False: Dynamo remembers the sizes it saw per function, not per model, so a second
# model in the process (a draft beside its target, a notebook's second LLM) would otherwise find every
# size it changed made symbolic, and symbolic loops run slower. Each model gets its own static graph
# (tests/model/test_one_path.py counts the symbols a second model's step creates).
compiled_decode_layer = compile_on_first_call(paged_decode_layer, dynamic=False)
compiled_head = compile_on_first_call(gemv, dynamic=False)   # the tied LM head of a compiled decode step
# The same layer for a step of any number of rows (>= 2, the one size the runner marks symbolic): the attention
# callable it is given is left out of the graph (backends.TorchBackend.forward_outside_graph), so Dynamo compiles the
# norm, QKV GEMM and RoPE before it as one graph and the output GEMM, residuals, MLP after it as another.
compiled_layer = compile_on_first_call(decoder_layer, dynamic=False)
# NEW: a step of decode rows only, ONE graph per layer (the C attention op inside): the pieces around an attention
# call outside the graph cost two graph entries per layer, each with its guards and wrappers.
compiled_decode_only_layer = compile_on_first_call(decode_only_layer, dynamic=False)
