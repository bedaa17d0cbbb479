"""QuantLinear's CPU fast path (minillm/quant/cpu_kernels.py: torch's packed int8 / int4 kernels)
against its reference path (QuantLinear.forward_reference: dequantise W, then F.linear).

Tolerance rule, from the dtypes (cpu_kernels' docstring says why the weights differ as they do).
With A = |x| @ |W|^T (the size of the K products an output sums), B = |x| @ S^T (S: the step s of
each weight's group), b the bias and u = 2^-24 (fp32) or 2^-8 (bf16) the unit roundoff:
  fp32: both paths multiply by bit-identical weights and differ only in the order of the sum, each
        within K u (A + |b|) of the exact value:         |fast - ref| <= 2 K u (A + |b|)
  bf16: x is bf16 in both. The reference rounds every weight to bf16 (<= u |w|); the fast path
        rounds s and o = (8 - z) s to bf16 (<= u (|q - 8| + |8 - z|) s <= 16 u s per weight); both
        round the output (<= u |y|) and the fast path rounds once more after adding the bias; both
        sum in fp32 (2 K 2^-24 A):            |fast - ref| <= u (A + 16 B + 3 (A + |b|)) + 2 K 2^-24 A
These worst-case bounds hold for any input but are loose (errors of random sign mostly cancel);
test_bf16_fast_path_is_the_documented_arithmetic is the tight check: the bf16 fast path equals its
stated arithmetic up to two roundings of its output.
"""
import pytest
import torch

from helpers import CharTokenizer, count_calls
from minillm import LLM, SamplingParams
from minillm.model.llama import random_model, tiny_config
from minillm.quant import cpu_kernels, int4, int8, load_quantized, quantize_model, save_quantized
from minillm.quant.linear import QuantLinear
from minillm.stages.kv_cache import generate_greedy

KERNELS = ("_weight_int8pack_mm", "_weight_int4pack_mm_for_cpu")
IN, OUT = 320, 80     # 320 = 2.5 x 128: group 128 runs as kernel group 64; 80 rows = a 64-row block + 16
FORMATS = [pytest.param("int8", {}, id="int8")] + [
    pytest.param("int", dict(bits=bits, group_size=g, symmetric=sym, perm=perm),
                 id=f"int{bits}-g{g}-{'sym' if sym else 'asym'}{'-perm' if perm else ''}")
    for bits, g, sym, perm in [(4, g, sym, perm) for g in (32, 64, 128) for sym in (False, True)
                               for perm in (False, True)] + [(3, 64, False, False)]]


def random_layer(fmt: str, kw: dict, in_f: int = IN, out_f: int = OUT, seed: int = 0) -> QuantLinear:
    """A QuantLinear with a bias; with perm, codes stored in a random column order as GPTQ's act-order does."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=gen) / in_f ** 0.5                # (out, in)
    bias = 0.1 * torch.randn(out_f, generator=gen)
    if fmt == "int8":
        return QuantLinear("int8", in_f, out_f, int8.quantize(w), bias=bias)
    order = torch.randperm(in_f, generator=gen) if kw["perm"] else None
    tensors = int4.quantize(w if order is None else w[:, order], kw["bits"], kw["group_size"], kw["symmetric"])
    if order is not None:
        tensors["perm"] = order.to(torch.int32)
    return QuantLinear("int", in_f, out_f, tensors, {"bits": kw["bits"], "group_size": kw["group_size"]}, bias)


def per_weight(layer: QuantLinear, per_group: torch.Tensor) -> torch.Tensor:
    """A per-group value (out, ng) of an "int" layer -> (out, in), in the weight's own column order."""
    t = int4.per_column(per_group.float(), layer.params["group_size"], layer.in_features)
    return t if "perm" not in layer.tensor_names else t[:, torch.argsort(layer.perm.long())]


def step_per_weight(layer: QuantLinear) -> torch.Tensor:
    """S (out, in): the scale of each weight's group."""
    if layer.fmt == "int8":
        return layer.scale.float().expand(-1, layer.in_features)
    return per_weight(layer, layer.scale)


def tolerance(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """The module docstring's bound on |fast - reference| for each output (rows, out)."""
    xa = x.float().abs()
    A = xa @ layer.dequantize().abs().T
    b = layer.bias.abs()
    fp32_sum = 2 * layer.in_features * 2 ** -24
    if x.dtype == torch.float32:
        return fp32_sum * (A + b)
    B = xa @ step_per_weight(layer).T
    return 2 ** -8 * (A + 16 * B + 3 * (A + b)) + fp32_sum * A


@pytest.fixture
def kernel_calls(monkeypatch):
    """The names of torch's packed-weight kernels, recorded as they are called: proves the fast path ran."""
    calls = []
    for name in KERNELS:
        def recorded(*args, _kernel=getattr(torch, name), _name=name):
            calls.append(_name)
            return _kernel(*args)
        monkeypatch.setattr(torch, name, recorded)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt,kw", FORMATS)
def test_fast_path_equals_reference_within_dtype_bound(monkeypatch, kernel_calls, fmt, kw, dtype):
    layer = random_layer(fmt, kw)
    assert layer.cpu_unsupported is None
    # the kernels' numbers at several rows too: fp32 dispatches only one row to them (KERNEL_MAX_ROWS)
    monkeypatch.setitem(cpu_kernels.KERNEL_MAX_ROWS, torch.float32, 8)
    for rows in (1, 5):                                                    # 5: two of the kernel's 4-row blocks
        x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(rows)).to(dtype)
        with torch.no_grad():
            fast = layer(x)
            assert len(kernel_calls) == 1
            with cpu_kernels.reference_path(layer):
                ref = layer(x)
            assert len(kernel_calls) == 1 and torch.equal(ref, layer.forward_reference(x))
        kernel_calls.clear()
        assert fast.dtype == dtype and fast.shape == (rows, OUT)
        assert ((fast.float() - ref.float()).abs() <= tolerance(layer, x)).all()


def as_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def bf16_kernel_arithmetic(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """What cpu_kernels' docstring says the bf16 fast path computes, in float64 before its output
    rounding: int8 (x @ q^T) * bf16(s); int x @ ((q - 8) * bf16(s) + bf16((8 - z) * s))^T; + bf16(bias)."""
    s = step_per_weight(layer).double()                                   # (out, in)
    q_minus_z = torch.round(layer.dequantize().double() / s)             # exact: W = (q - z) s in fp32
    if layer.fmt == "int8":
        w = q_minus_z * as_bf16(s)
    else:
        symmetric_z = torch.tensor(2.0 ** (layer.params["bits"] - 1))
        z = per_weight(layer, layer.zero) if "zero" in layer.tensor_names else symmetric_z
        eight_minus_z = 8 - z.double()                                    # (out, in), or one value if symmetric
        w = (q_minus_z - eight_minus_z) * as_bf16(s) + as_bf16(eight_minus_z * s)
    return x.double() @ w.T + as_bf16(layer.bias)                        # both paths add the bias in bf16


@pytest.mark.parametrize("fmt,kw", FORMATS)
def test_bf16_fast_path_is_the_documented_arithmetic(fmt, kw):
    """Tight check of the mapping onto the kernels: two bf16 roundings of the output (the kernel's,
    then after the bias) and the fp32 sum are all that separate the fast path from its definition."""
    layer = random_layer(fmt, kw)
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        fast = layer(x).double()
    expected = bf16_kernel_arithmetic(layer, x)
    A = x.double().abs() @ layer.dequantize().double().abs().T
    tol = 2 * 2 ** -8 * (expected.abs() + layer.bias.double().abs()) + 2 * IN * 2 ** -24 * A
    assert ((fast - expected).abs() <= tol).all()


def test_rows_autograd_and_dtype_decide_the_path(kernel_calls):
    """Past KERNEL_MAX_ROWS (a prefill), with autograd on, or for fp16, the reference path runs."""
    layer = random_layer("int", dict(bits=4, group_size=64, symmetric=False, perm=False))
    limit = cpu_kernels.KERNEL_MAX_ROWS[torch.bfloat16]
    with torch.no_grad():
        layer(torch.randn(2, limit // 2, IN, dtype=torch.bfloat16))        # (B, T, in): B T rows = limit
        assert len(kernel_calls) == 1
        big = torch.randn(limit + 1, IN, dtype=torch.bfloat16)
        assert torch.equal(layer(big), layer.forward_reference(big))
        layer(torch.randn(2, IN))                                         # fp32: two rows > 1
        layer(torch.randn(1, IN, dtype=torch.float16))
    x = torch.randn(1, IN, requires_grad=True)
    layer(x).sum().backward()                                             # the reference path has a backward
    assert x.grad is not None and len(kernel_calls) == 1


def test_formats_without_a_kernel_say_why_and_run_the_reference(kernel_calls):
    from minillm.quant import quantize_linear

    layers = [quantize_linear(torch.nn.Linear(IN, OUT), "nf4"),
              random_layer("int", dict(bits=4, group_size=48, symmetric=False, perm=False), in_f=96),
              random_layer("int", dict(bits=4, group_size=32, symmetric=False, perm=False), out_f=40)]
    for layer, why in zip(layers, ("NF4", "group_size 48", "out_features 40")):
        assert why in layer.cpu_unsupported
        x = torch.randn(1, layer.in_features, dtype=torch.bfloat16)
        with torch.no_grad():
            assert torch.equal(layer(x), layer.forward_reference(x))
    assert kernel_calls == []


def test_packed_once_and_repacked_when_a_stored_tensor_changes(monkeypatch):
    converts = count_calls(monkeypatch, "_convert_weight_to_int4pack_for_cpu", torch)
    layer = random_layer("int", dict(bits=4, group_size=32, symmetric=False, perm=False))
    x = torch.randn(1, IN, dtype=torch.bfloat16)
    with torch.no_grad():
        first = layer(x)
        assert torch.equal(layer(x), first) and len(converts) == 1        # cached on the module
        layer.scale.mul_(2)                                               # an in-place write moves its version
        assert len(converts) == 1
        ref = layer.forward_reference(x)
        again = layer(x)
    assert len(converts) == 2 and ((again.float() - ref.float()).abs() <= tolerance(layer, x)).all()


# ---- whole models: greedy tokens on the fast path equal the reference path's ------------------------

PROMPTS = [[5, 17, 99, 3, 42, 8, 250], [7, 7, 130, 61]]
N_TOKENS = 6


def tiny_quantized(method: str, dtype: torch.dtype, **kw):
    return quantize_model(random_model(tiny_config(), seed=0, dtype=dtype), method, **kw)


# fp32 sends one row at a time to the kernels: one prompt; bf16 up to 64 rows: two prompts
@pytest.mark.parametrize("dtype,n_prompts", [(torch.float32, 1), (torch.bfloat16, 2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method,kw", [("int8", {}), ("int4", {"group_size": 32}),
                                       ("int4", {"group_size": 128, "symmetric": True})])
def test_generate_greedy_fast_equals_reference(kernel_calls, method, kw, dtype, n_prompts):
    model = tiny_quantized(method, dtype, **kw)
    prompts = PROMPTS[:n_prompts]
    fast = generate_greedy(model, prompts, N_TOKENS)
    assert len(kernel_calls) >= 7 * model.cfg.n_layers * (N_TOKENS - 1)   # every decode step, every layer
    with cpu_kernels.reference_path(model):
        assert generate_greedy(model, prompts, N_TOKENS) == fast


def test_engine_fast_equals_reference(kernel_calls):
    """LLM's batching engine (model_runner's non-fused branch) over a tiny bf16 model LLM quantised (int4, g128)."""
    model = random_model(tiny_config(), seed=0, dtype=torch.bfloat16)
    llm = LLM(model=model, tokenizer=CharTokenizer(), device="cpu", max_model_len=64, quantization="int4")
    requests = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
    fast = [o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)]
    assert llm._engine is not None and len(kernel_calls) > 0
    kernel_calls.clear()
    with cpu_kernels.reference_path(llm.model):                       # an engine built without the packs
        reference = LLM(model=llm.model, tokenizer=CharTokenizer(), device="cpu", max_model_len=64)
        ref = [o.outputs[0].token_ids for o in reference.generate(requests, params, use_tqdm=False)]
    assert fast == ref and kernel_calls == []


def test_save_load_roundtrip_runs_the_fast_path(tmp_path, kernel_calls):
    model = tiny_quantized("int4", torch.bfloat16, group_size=32)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        out = model(ids)
        loaded = load_quantized(None, save_quantized(model, tmp_path / "q.safetensors"))
        kernel_calls.clear()
        assert torch.equal(loaded(ids), out)
    assert len(kernel_calls) == 7 * model.cfg.n_layers
    assert all(m.cpu_unsupported is None for m in loaded.modules() if isinstance(m, QuantLinear))


# ---- batch 1 on LLM: the engine's compiled decode step over packed weights ------------------------

def llm_tokens(llm, prompts=PROMPTS[:1], n=N_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


@pytest.mark.usefixtures("fresh_compile_caches")     # conftest: compiled here, not eager past Dynamo's recompile limit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_llm_batch1_decode_runs_the_compiled_step_on_packed_weights(method, dtype):
    llm = LLM(model=random_model(tiny_config(), seed=0, dtype=dtype), tokenizer=CharTokenizer(), device="cpu",
              max_model_len=64, quantization=method)
    assert isinstance(llm.model.lm_head, QuantLinear) and llm.model.lm_head.fmt == "int8"   # the CPU default
    fast = llm_tokens(llm)
    runner = llm.engine.runner
    assert runner.compiled_decode_steps == N_TOKENS - 1                      # every decode token, one row
    packs = runner.decode_weights
    assert len(packs) == llm.config.n_layers and all(isinstance(w, tuple) for w in packs[0][1:3] + packs[0][4:6])
    with cpu_kernels.reference_path(llm.model):                            # dequantise + F.linear, eager
        reference = LLM(model=llm.model, tokenizer=CharTokenizer(), device="cpu", max_model_len=64)
        assert reference.engine.runner.decode_weights is None
        assert llm_tokens(reference) == fast


def test_qkv_and_gate_up_are_one_kernel_call_each_and_equal_separate_calls():
    model = tiny_quantized("int4", torch.bfloat16, group_size=32)
    attn = model.layers[0].attn
    x = torch.randn(1, model.cfg.dim, dtype=torch.bfloat16)
    weight, scale, group, perm = cpu_kernels.fused_pack([attn.wq, attn.wk, attn.wv], torch.bfloat16)
    with torch.no_grad():
        fused = cpu_kernels.packed_mm(x, weight, scale, group, perm)
        separate = torch.cat([attn.wq(x), attn.wk(x), attn.wv(x)], dim=-1)
    assert torch.equal(fused, separate)
    nf4 = quantize_model(random_model(tiny_config(), seed=0), "nf4")
    assert cpu_kernels.fused_pack([nf4.layers[0].attn.wq], torch.float32) is None


@pytest.mark.usefixtures("fresh_compile_caches")     # conftest: compiled here, not eager past Dynamo's recompile limit
def test_gptq_act_order_layers_sharing_an_input_share_one_permutation():
    model = random_model(tiny_config(), seed=0, dtype=torch.bfloat16)
    calib = torch.randint(0, model.cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    llm = LLM(model=quantize_model(model, "gptq", calibration_ids=calib), tokenizer=CharTokenizer(), device="cpu",
              max_model_len=64)                                            # a model quantised already
    attn = llm.model.layers[0].attn
    assert all("perm" in m.tensor_names for m in (attn.wq, attn.wk, attn.wv))
    fast = llm_tokens(llm)
    runner = llm.engine.runner
    assert runner.compiled_decode_steps == N_TOKENS - 1 and runner.decode_weights[0][1][3] is not None   # the perm
    with cpu_kernels.reference_path(llm.model):
        reference = LLM(model=llm.model, tokenizer=CharTokenizer(), device="cpu", max_model_len=64)
        assert llm_tokens(reference) == fast


def test_an_int8_lm_head_is_its_own_matrix_and_survives_save_and_load(tmp_path):
    base = random_model(tiny_config(), seed=0)
    model = quantize_model(random_model(tiny_config(), seed=0), "int8", lm_head="int8")
    assert isinstance(model.lm_head, QuantLinear) and torch.equal(model.embed.weight, base.embed.weight)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        out = model(ids)
        loaded = load_quantized(None, save_quantized(model, tmp_path / "q.safetensors"))
        assert torch.equal(loaded(ids), out) and isinstance(loaded.lm_head, QuantLinear)
        h = torch.randn(3, base.cfg.dim)
        exact = base.logits(h)
        assert (model.logits(h) - exact).abs().max() <= 0.02 * exact.abs().max()   # per-row int8: ~1/254 steps
    with pytest.raises(ValueError, match="lm_head = 'int4'; allowed: None"):
        quantize_model(random_model(tiny_config(), seed=0), "int8", lm_head="int4")
