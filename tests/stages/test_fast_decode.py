"""The fast batch-1 path (fused projections, RoPE table, SDPA) gives the baseline's tokens.
fast_decode.FastDecoder is built once per model; what it runs (GEMV, compiled step, 2-byte build, a
compiler failure) is recorded on it, never on the model or in the process."""
import pytest
import torch
import torch.nn as nn

from minillm import SamplingParams
from minillm.model.llama import ATTENTION_BACKENDS, random_model, tiny_config
from minillm.model.positions import RopeTable
from minillm.stages import fast_decode
from minillm.stages.fast_decode import FastDecoder, fuse_projections, generate_greedy_fast, is_fused
from minillm.stages.kv_cache import KVCache, forward_cached, generate_greedy_naive
from helpers import count_calls, greedy_under_naive_forward


pytestmark = pytest.mark.usefixtures("fresh_compile_caches")   # conftest: each test compiles afresh


def _fast_greedy(model, prompt, n, chunks=(None,), **options):
    """Greedy tokens by FastDecoder(model, **options).forward, the prompt in one or two chunks."""
    decoder = FastDecoder(model, **options)
    cache = KVCache(model.cfg, 1, len(prompt) + n)
    rope = RopeTable(model.cfg.head_dim, model.cfg.rope_theta, len(prompt) + n, "cpu")
    cut = chunks[0] or len(prompt)
    logits = decoder.forward(torch.tensor([prompt[:cut]]), cache, rope)
    if cut < len(prompt):                                     # prefill in two chunks
        logits = decoder.forward(torch.tensor([prompt[cut:]]), cache, rope)
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = decoder.forward(torch.tensor([[out[-1]]]), cache, rope)
    return out


@pytest.mark.parametrize("chunk", [None, 1, 5])
def test_tiny_fast_equals_naive(chunk):
    model = random_model(tiny_config(), seed=1)
    prompt = [9, 8, 7, 6, 5, 4, 3]
    ref = generate_greedy_naive(model, prompt, 64)
    fuse_projections(model)
    assert is_fused(model)
    assert _fast_greedy(model, prompt, 64, (chunk,)) == ref
    assert generate_greedy_fast(model, prompt, 64) == ref
    assert FastDecoder(model).generate_greedy(prompt, 64) == ref


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_every_attention_backend_gives_the_baseline_tokens(backend):
    """The prefill's second chunk attends after a cached prefix (the causal mask with an offset)."""
    model = random_model(tiny_config(), seed=1)
    prompt = [9, 8, 7, 6, 5, 4, 3]
    ref = generate_greedy_naive(model, prompt, 16)
    fuse_projections(model)
    assert _fast_greedy(model, prompt, 16, (3,), attention_backend=backend, compiled_step=False) == ref


def test_fused_weights_are_views_not_copies():
    model = fuse_projections(random_model(tiny_config(), seed=2))
    attn = model.layers[0].attn
    assert attn.wq.weight.data_ptr() == attn.wqkv.weight.data_ptr()
    with torch.no_grad():
        attn.wqkv.weight[0, 0] = 123.0
    assert attn.wq.weight[0, 0] == 123.0


def test_replacing_a_projection_disables_the_fast_path():
    model = fuse_projections(random_model(tiny_config(), seed=3))
    model.layers[1].ffn.w_up = nn.Linear(96, 192, bias=False)
    assert not is_fused(model)
    assert FastDecoder(model).kind == "baseline"                   # a decoder built now runs forward_cached


def test_building_a_decoder_plants_nothing_on_the_model():
    """The snapshot of the decode weights lives on the decoder; is_fused only looks."""
    model = fuse_projections(random_model(tiny_config(), seed=3))
    before = set(vars(model))
    decoder = FastDecoder(model)
    assert is_fused(model) and set(vars(model)) == before
    assert decoder.kind == "float" and len(decoder.decode_weights) == model.cfg.n_layers
    assert decoder.decode_weights[0][1] is not model.layers[0].attn.wqkv.weight          # detached, not the Parameter
    assert decoder.decode_weights[0][1].data_ptr() == model.layers[0].attn.wqkv.weight.data_ptr()   # no copy


def test_real_model_llm_generate_equals_naive_greedy(llm):
    """128 tokens of one prompt through LLM.generate: each the naive forward's greedy choice given the
    ones before it (teacher-forced; tests/stages/test_kv_cache.py ties the cached baseline to the same forward)."""
    assert is_fused(llm.model)
    prompt = llm.get_tokenizer().encode("Three facts about the planet Mars:")
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 128
    assert greedy_under_naive_forward(llm.model, prompt, out.outputs[0].token_ids)


# ---- item 5 (GEMV modes) and item 6 (the compiled decode step) ----------------------------------

@pytest.mark.parametrize("gemv", ["linear", "mv", "compiled"])
def test_every_gemv_mode_gives_the_baseline_tokens(gemv):
    model = random_model(tiny_config(), seed=4)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ref = generate_greedy_naive(model, prompt, 32)
    assert generate_greedy_fast(model, prompt, 32, gemv=gemv, compiled_step=False) == ref


def _two_caches(model, prompt):
    """Two identical caches holding the prompt, and the prompt's last logits."""
    caches = [KVCache(model.cfg, 1, len(prompt) + 8, model.embed.weight.dtype) for _ in range(2)]
    rope = RopeTable(model.cfg.head_dim, model.cfg.rope_theta, len(prompt) + 8, "cpu")
    for cache in caches:
        logits = FastDecoder(model).forward(torch.tensor([prompt]), cache, rope)
    return caches, rope, logits


@pytest.mark.parametrize("n_kv_heads", [6, 2, 1])                 # MHA, GQA 3:1, MQA
def test_compiled_step_writes_the_same_cache_and_logits(n_kv_heads):
    """Internals, not only tokens: one compiled decode step stores the same K/V at the same position
    and gives the same logits as the eager loop (fp32, 1e-5), for every group size."""
    model = fuse_projections(random_model(tiny_config(n_kv_heads=n_kv_heads), seed=5))
    prompt = [7, 3, 9, 1, 4]
    (eager, compiled), rope, logits = _two_caches(model, prompt)
    token = torch.tensor([[int(logits.argmax())]])
    want = FastDecoder(model, compiled_step=False).forward(token, eager, rope)   # (1, V)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    decoder = FastDecoder(model, compiled_step=True)
    got = decoder.forward(token, compiled, rope)                                 # (1, V)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs       # it really compiled,
    assert decoder.compile_failed is None                                        # and ran compiled
    assert int(compiled.lengths[0]) == int(eager.lengths[0]) == len(prompt) + 1
    torch.testing.assert_close(compiled.k, eager.k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled.v, eager.v, rtol=1e-5, atol=1e-5)
    assert compiled.k[:, :, :, len(prompt) + 1:].abs().sum() == 0                # nothing written past pos
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    ref = generate_greedy_naive(model, prompt, 48)
    assert generate_greedy_fast(model, prompt, 48, compiled_step=True) == ref


def test_compiled_step_in_bfloat16_stays_close_to_the_eager_step():
    """bf16: the compiled step keeps intermediate values in fp32 where the eager ops round to bf16,
    so the logits differ by rounding only (stated tolerance: 1% of the logits' range)."""
    model = fuse_projections(random_model(tiny_config(), seed=6, dtype=torch.bfloat16))
    (eager, compiled), rope, logits = _two_caches(model, [5, 6, 7, 8])
    token = torch.tensor([[int(logits.argmax())]])
    want = FastDecoder(model, compiled_step=False).forward(token, eager, rope).float()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    got = FastDecoder(model, compiled_step=True).forward(token, compiled, rope).float()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs
    assert (got - want).abs().max() <= 0.01 * (want.max() - want.min())


def test_without_a_compiler_the_fast_path_warns_and_still_gives_the_tokens(monkeypatch):
    """The failure is recorded on the decoder (compile_failed), warned once; that decoder then runs
    the eager loop and torch.mv. Another decoder starts afresh: nothing process-wide remembers it."""
    def no_compiler(*args):
        raise torch._inductor.exc.InvalidCxxCompiler()        # what Inductor raises without g++
    monkeypatch.setattr(fast_decode, "_compiled_decode_layer", no_compiler)
    monkeypatch.setattr(fast_decode, "_compiled_decode_layer_16bit", no_compiler)
    monkeypatch.setattr(fast_decode, "_compiled_dot", no_compiler)
    model = random_model(tiny_config(), seed=7)
    prompt = [2, 7, 1, 8, 2, 8]
    ref = generate_greedy_naive(model, prompt, 16)
    decoder = FastDecoder(fuse_projections(model), compiled_step=True)
    with pytest.warns(UserWarning, match="could not build"):
        assert decoder.generate_greedy(prompt, 16) == ref
    assert "No working C++ compiler" in decoder.compile_failed
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")                               # warned once: eager from then on
        assert decoder.generate_greedy(prompt, 16) == ref
    assert FastDecoder(model).compile_failed is None


def test_bad_gemv_build_or_compiled_step_requests_are_refused():
    model = fuse_projections(random_model(tiny_config(), seed=8))
    cache = KVCache(model.cfg, 1, 8)
    rope = RopeTable(model.cfg.head_dim, model.cfg.rope_theta, 8, "cpu")
    with pytest.raises(ValueError, match="allowed: 'auto', 'compiled', 'mv', 'linear'"):
        FastDecoder(model, gemv="fast")
    with pytest.raises(ValueError, match="allowed: None, 'default', 'materialised'"):
        FastDecoder(model, build="fastest")
    with pytest.raises(ValueError, match="batch-1"):
        FastDecoder(model).forward(torch.tensor([[1], [2]]), cache, rope)
    model.layers[0].attn.wo.bias = nn.Parameter(torch.zeros(model.cfg.dim))
    assert is_fused(model)                                         # the decoder built now sees the bias
    decoder = FastDecoder(model)
    assert decoder.decode_weights is None and not decoder.compiled_step
    decoder.forward(torch.tensor([[1, 2]]), cache, rope)
    with pytest.raises(ValueError, match="bias-free"):
        FastDecoder(model, compiled_step=True)
    assert decoder.forward(torch.tensor([[3]]), cache, rope).shape == (1, model.cfg.vocab_size)


def test_the_compiled_gemv_is_refused_on_a_gpu_and_auto_picks_torch_mv_there():
    from minillm.stages.fast_decode import resolve_gemv
    with pytest.raises(ValueError, match="gemv='compiled' is the CPU GEMV; on a GPU use 'mv' or 'auto'"):
        resolve_gemv("compiled", "cuda")
    assert resolve_gemv("auto", "cuda") == "mv"
    assert resolve_gemv("auto", "cpu") == "compiled"
    meta = fuse_projections(random_model(tiny_config(), seed=9)).to("meta")    # not a CPU model: no compiled step
    decoder = FastDecoder(meta)
    assert decoder.gemv == "mv" and decoder.decode_weights is None and not decoder.compiled_step
    assert not decoder.can_verify


# ---- item 7: the compiled verification step (all T logits) ---------------------------------------

def _cached_pair(model, prompt, start, max_len=48):
    """Two caches holding prompt[:start], and the RoPE table."""
    caches = [KVCache(model.cfg, 1, max_len) for _ in range(2)]
    for cache in caches:
        forward_cached(model, torch.tensor([prompt[:start]]), cache)
    return caches, RopeTable(model.cfg.head_dim, model.cfg.rope_theta, max_len, "cpu")


def test_verify_step_gives_every_logit_of_forward_cached_and_runs_compiled(monkeypatch):
    """FastDecoder.verify returns the logits of ALL T positions and writes the same K/V as
    forward_cached(all_logits=True) (fp32, 1e-5), for T = 2, 5, 9 and T = 1 (the decode step) at
    several start positions. It ran compiled: the compiled verify_layer was called once per layer
    for every T >= 2, nothing fell back to eager, and at most two graphs served all T and starts
    (pos turns symbolic at the first new position; T and the cache length are symbolic from the start)."""
    model = fuse_projections(random_model(tiny_config(), seed=12))
    decoder = FastDecoder(model)
    compiled, calls = fast_decode._compiled_verify_layer, []

    def counting(h, *weights_cache_rope_and_config):
        calls.append(h.shape[0])
        return compiled(h, *weights_cache_rope_and_config)

    monkeypatch.setattr(fast_decode, "_compiled_verify_layer", counting)
    prompt = list(range(3, 43))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for T in (2, 5, 9, 1):
        if T == 1:                                           # all T >= 2 done: count their graphs
            assert 1 <= torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs <= 2
        for start in (2, 11, 29):
            (reference, verified), rope = _cached_pair(model, prompt, start)
            tokens = torch.tensor([prompt[start:start + T]])
            want = forward_cached(model, tokens, reference, all_logits=True)[0]     # (T, V)
            got = decoder.verify(tokens, verified, rope)                             # (T, V)
            assert got.shape == (T, model.cfg.vocab_size)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert int(verified.lengths[0]) == int(reference.lengths[0]) == start + T
            torch.testing.assert_close(verified.k, reference.k, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(verified.v, reference.v, rtol=1e-5, atol=1e-5)
    assert calls == [T for T in (2, 5, 9) for _ in range(3) for _ in range(model.cfg.n_layers)]
    assert decoder.compile_failed is None


def test_verify_step_without_a_compiler_warns_and_still_gives_every_logit(monkeypatch):
    def no_compiler(*args):
        raise torch._inductor.exc.InvalidCxxCompiler()
    monkeypatch.setattr(fast_decode, "_compiled_verify_layer", no_compiler)
    model = fuse_projections(random_model(tiny_config(), seed=13))
    prompt = [4, 8, 15, 16, 23, 42, 4, 8]
    (reference, verified), rope = _cached_pair(model, prompt, 3, max_len=16)
    tokens = torch.tensor([prompt[3:]])
    decoder = FastDecoder(model)
    with pytest.warns(UserWarning, match="could not build"):
        got = decoder.verify(tokens, verified, rope)
    assert "No working C++ compiler" in decoder.compile_failed
    torch.testing.assert_close(got, forward_cached(model, tokens, reference, all_logits=True)[0],
                               rtol=1e-5, atol=1e-5)


def test_bad_verify_requests_are_refused():
    model = fuse_projections(random_model(tiny_config(), seed=14))
    cache = KVCache(model.cfg, 1, 8)
    rope = RopeTable(model.cfg.head_dim, model.cfg.rope_theta, 8, "cpu")
    decoder = FastDecoder(model)
    with pytest.raises(ValueError, match="batch-1"):
        decoder.verify(torch.tensor([[1, 2], [3, 4]]), cache, rope)
    with pytest.raises(ValueError, match="holds 8 positions; this step needs 9"):
        decoder.verify(torch.tensor([list(range(9))]), cache, rope)
    model.layers[0].attn.wo.bias = nn.Parameter(torch.zeros(model.cfg.dim))
    assert is_fused(model)                                         # a decoder built now sees the bias
    with pytest.raises(ValueError, match="bias-free"):
        FastDecoder(model).verify(torch.tensor([[1, 2]]), cache, rope)


def test_a_deepcopied_fused_model_is_fused_again():
    """A deepcopy turns the fused views into separate copies: fuse_projections must fuse again rather than
    skip the layer, or LLM(model=copy) would silently lose the fast path."""
    import copy

    model = fuse_projections(random_model(tiny_config(), seed=0))
    twin = copy.deepcopy(model)
    assert not is_fused(twin)
    fuse_projections(twin)
    assert is_fused(twin)
    tokens = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(twin(tokens), model(tokens))


def test_tune_times_whole_steps_of_both_16bit_builds_once_and_records_the_faster(monkeypatch):
    """The 2-byte build is a recorded choice: the default until tune() (an explicit step, never inside a
    decode step) times whole steps (every layer) with each build, records the faster in decoder.build and
    leaves no trace in the tokens; a given build is taken untimed; fp32 is never timed. Stand-ins: the
    'materialised' build is made slower by a sleep, then the default one; both run decode_layer itself."""
    import time

    calls, delays = [], {"default": 0.0, "materialised": 0.002}

    def build(name):
        def run(*args):
            calls.append(name)
            time.sleep(delays[name])
            return fast_decode.decode_layer(*args)
        return run
    monkeypatch.setattr(fast_decode, "_compiled_decode_layer", build("default"))
    monkeypatch.setattr(fast_decode, "_compiled_decode_layer_16bit", build("materialised"))
    model = fuse_projections(random_model(tiny_config(), seed=6, dtype=torch.bfloat16))
    prompt, n_new, n_layers = [5, 6, 7, 8], 5, model.cfg.n_layers
    decoder = FastDecoder(model)
    assert decoder.build == fast_decode.DEFAULT_BUILD == "default" and decoder.build_timings is None
    untuned = decoder.generate_greedy(prompt, n_new)
    assert calls == ["default"] * (n_new - 1) * n_layers                  # no step ever times anything
    calls.clear()
    assert decoder.tune() == "default" and set(decoder.build_timings) == set(fast_decode.BUILDS_16BIT)
    timed = (1 + fast_decode.CHOICE_ROUNDS) * n_layers                    # compile + timed rounds, whole steps
    assert calls.count("materialised") == calls.count("default") == timed
    calls.clear()
    assert decoder.generate_greedy(prompt, n_new) == untuned               # timing wrote nothing lasting
    assert calls == ["default"] * (n_new - 1) * n_layers
    delays.update(default=0.002, materialised=0.0)
    assert FastDecoder(model).tune() == "materialised"                     # the other way round
    calls.clear()
    given = FastDecoder(model, build="materialised")
    given.generate_greedy(prompt, n_new)
    assert given.build_timings is None and calls == ["materialised"] * (n_new - 1) * n_layers
    calls.clear()
    fp32 = FastDecoder(fuse_projections(random_model(tiny_config(), seed=6)))
    assert fp32.tune() == "default" and fp32.build_timings is None and calls == []   # fp32: never timed
    fp32.generate_greedy(prompt, n_new)
    assert calls == ["default"] * (n_new - 1) * n_layers                   # fp32 takes the default build


def test_a_quantised_model_decodes_on_packed_weights_and_quant_kernels_false_runs_the_modules():
    """Item 8: int8 / int4 QuantLinears: the compiled step over packs built once by the decoder
    (quant_kernels=True), or forward_cached over the QuantLinears (quant_kernels=False); same greedy
    tokens in fp32 as kv_cache.generate_greedy."""
    from minillm.stages.kv_cache import generate_greedy
    from minillm.quant import quantize_model

    prompt = [5, 17, 99, 3, 42, 8, 250]
    for method, kw in (("int8", {}), ("int4", {"group_size": 32})):
        model = quantize_model(random_model(tiny_config(), seed=0), method, **kw)
        packed = FastDecoder(model)
        assert packed.kind == "packed" and packed.compiled_step and packed.can_verify
        assert all(isinstance(w, tuple) for w in packed.decode_weights[0][1:3] + packed.decode_weights[0][4:])
        modules = FastDecoder(model, quant_kernels=False)
        assert modules.kind == "baseline" and modules.decode_weights is None
        ref = generate_greedy(model, [prompt], 6)[0]
        assert packed.generate_greedy(prompt, 6) == modules.generate_greedy(prompt, 6) == ref


def test_weights_only_step_runs_every_linear_once_per_layer(monkeypatch):
    """Lesson 01's floor: one token's weight GEMVs and nothing else (7 linears per layer, then the LM head)."""
    model = random_model(tiny_config(), seed=4)
    calls = count_calls(monkeypatch, "linear", fast_decode)
    fast_decode.weights_only_step(model)
    assert len(calls) == 7 * model.cfg.n_layers
