"""The fast batch-1 path (fused projections, RoPE table, SDPA) gives the baseline's tokens."""
import pytest
import torch
import torch.nn as nn

from minillm import SamplingParams, fast_decode
from minillm.fast_decode import forward_fast, forward_verify, fuse_projections, generate_greedy_fast, is_fused
from minillm.kv_cache import KVCache, forward_cached, generate_greedy, generate_greedy_naive
from minillm.model import ATTENTION_BACKENDS, random_model, tiny_config
from minillm.positions import RopeTable


@pytest.fixture(autouse=True)
def fresh_compile_caches():
    """Each test compiles afresh: Dynamo allows 8 recompiles per function per process, and past
    that it runs the function eagerly, which would let a compiled-vs-eager test compare eager
    with eager. (Inductor's disk cache keeps the recompiles cheap.)"""
    torch._dynamo.reset()
    yield


def _fast_greedy(model, prompt, n, chunks=(None,), **options):
    """Greedy tokens by forward_fast (options: its keyword arguments)."""
    cache = KVCache(model.cfg, 1, len(prompt) + n)
    rope = RopeTable(model.cfg.head_dim, model.cfg.rope_theta, len(prompt) + n, "cpu")
    cut = chunks[0] or len(prompt)
    logits = forward_fast(model, torch.tensor([prompt[:cut]]), cache, rope, **options)
    if cut < len(prompt):                                     # prefill in two chunks
        logits = forward_fast(model, torch.tensor([prompt[cut:]]), cache, rope, **options)
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = forward_fast(model, torch.tensor([[out[-1]]]), cache, rope, **options)
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


def test_real_model_llm_generate_equals_cached_baseline(llm):
    assert is_fused(llm.model)
    prompt = llm.get_tokenizer().encode("Three facts about the planet Mars:")
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == generate_greedy(llm.model, [prompt], 128)[0]


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
        logits = forward_fast(model, torch.tensor([prompt]), cache, rope)
    return caches, rope, logits


@pytest.mark.parametrize("n_kv_heads", [6, 2, 1])                 # MHA, GQA 3:1, MQA
def test_compiled_step_writes_the_same_cache_and_logits(n_kv_heads):
    """Internals, not only tokens: one compiled decode step stores the same K/V at the same position
    and gives the same logits as the eager loop (fp32, 1e-5), for every group size."""
    model = fuse_projections(random_model(tiny_config(n_kv_heads=n_kv_heads), seed=5))
    prompt = [7, 3, 9, 1, 4]
    (eager, compiled), rope, logits = _two_caches(model, prompt)
    token = torch.tensor([[int(logits.argmax())]])
    want = forward_fast(model, token, eager, rope, compiled_step=False)          # (1, V)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    got = forward_fast(model, token, compiled, rope, compiled_step=True)         # (1, V)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs       # it really compiled,
    assert fast_decode._compiler_broken is None                                  # and ran compiled
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
    want = forward_fast(model, token, eager, rope, compiled_step=False).float()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    got = forward_fast(model, token, compiled, rope, compiled_step=True).float()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs
    assert (got - want).abs().max() <= 0.01 * (want.max() - want.min())


def test_without_a_compiler_the_fast_path_warns_and_still_gives_the_tokens(monkeypatch):
    def no_compiler(*args):
        raise torch._inductor.exc.InvalidCxxCompiler()        # what Inductor raises without g++
    monkeypatch.setattr(fast_decode, "_compiler_broken", None)    # restored after the test
    monkeypatch.setattr(fast_decode, "_compiled_decode_layer", no_compiler)
    monkeypatch.setattr(fast_decode, "_compiled_decode_layer_16bit", no_compiler)
    monkeypatch.setattr(fast_decode, "_compiled_dot", no_compiler)
    model = random_model(tiny_config(), seed=7)
    prompt = [2, 7, 1, 8, 2, 8]
    ref = generate_greedy_naive(model, prompt, 16)
    with pytest.warns(UserWarning, match="could not build"):
        assert generate_greedy_fast(model, prompt, 16, compiled_step=True) == ref
    assert "No working C++ compiler" in fast_decode._compiler_broken
    assert generate_greedy_fast(model, prompt, 16) == ref            # "auto" now picks the eager path


def test_bad_gemv_or_compiled_step_requests_are_refused():
    model = fuse_projections(random_model(tiny_config(), seed=8))
    cache = KVCache(model.cfg, 1, 8)
    rope = RopeTable(model.cfg.head_dim, model.cfg.rope_theta, 8, "cpu")
    with pytest.raises(ValueError, match="allowed: 'auto', 'compiled', 'mv', 'linear'"):
        forward_fast(model, torch.tensor([[1, 2]]), cache, rope, gemv="fast")
    model.layers[0].attn.wo.bias = nn.Parameter(torch.zeros(model.cfg.dim))
    assert is_fused(model)                                         # the per-sequence check sees the bias
    forward_fast(model, torch.tensor([[1, 2]]), cache, rope)
    with pytest.raises(ValueError, match="bias-free"):
        forward_fast(model, torch.tensor([[3]]), cache, rope, compiled_step=True)
    assert forward_fast(model, torch.tensor([[3]]), cache, rope).shape == (1, model.cfg.vocab_size)


def test_the_compiled_gemv_is_refused_on_a_gpu_and_auto_picks_torch_mv_there():
    from minillm.fast_decode import can_compile_step, resolve_gemv
    with pytest.raises(ValueError, match="gemv='compiled' is the CPU GEMV; on a GPU use 'mv' or 'auto'"):
        resolve_gemv("compiled", "cuda")
    assert resolve_gemv("auto", "cuda") == "mv"
    assert resolve_gemv("auto", "cpu") == "compiled"
    assert not can_compile_step(fuse_projections(random_model(tiny_config(), seed=9)), "cuda")


# ---- item 7: the compiled verification step (all T logits) ---------------------------------------

def _cached_pair(model, prompt, start, max_len=48):
    """Two caches holding prompt[:start], and the RoPE table."""
    caches = [KVCache(model.cfg, 1, max_len) for _ in range(2)]
    for cache in caches:
        forward_cached(model, torch.tensor([prompt[:start]]), cache)
    return caches, RopeTable(model.cfg.head_dim, model.cfg.rope_theta, max_len, "cpu")


def test_verify_step_gives_every_logit_of_forward_cached_and_runs_compiled(monkeypatch):
    """forward_verify returns the logits of ALL T positions and writes the same K/V as
    forward_cached(all_logits=True) (fp32, 1e-5), for T = 2, 5, 9 and T = 1 (the decode step) at
    several start positions. It ran compiled: the compiled verify_layer was called once per layer
    for every T >= 2, nothing fell back to eager, and at most two graphs served all T and starts
    (pos turns symbolic at the first new position; T and the cache length are symbolic from the start)."""
    model = fuse_projections(random_model(tiny_config(), seed=12))
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
            got = forward_verify(model, tokens, verified, rope)                      # (T, V)
            assert got.shape == (T, model.cfg.vocab_size)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert int(verified.lengths[0]) == int(reference.lengths[0]) == start + T
            torch.testing.assert_close(verified.k, reference.k, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(verified.v, reference.v, rtol=1e-5, atol=1e-5)
    assert calls == [T for T in (2, 5, 9) for _ in range(3) for _ in range(model.cfg.n_layers)]
    assert fast_decode._compiler_broken is None


def test_verify_step_without_a_compiler_warns_and_still_gives_every_logit(monkeypatch):
    def no_compiler(*args):
        raise torch._inductor.exc.InvalidCxxCompiler()
    monkeypatch.setattr(fast_decode, "_compiler_broken", None)    # restored after the test
    monkeypatch.setattr(fast_decode, "_compiled_verify_layer", no_compiler)
    model = fuse_projections(random_model(tiny_config(), seed=13))
    prompt = [4, 8, 15, 16, 23, 42, 4, 8]
    (reference, verified), rope = _cached_pair(model, prompt, 3, max_len=16)
    tokens = torch.tensor([prompt[3:]])
    with pytest.warns(UserWarning, match="could not build"):
        got = forward_verify(model, tokens, verified, rope)
    torch.testing.assert_close(got, forward_cached(model, tokens, reference, all_logits=True)[0],
                               rtol=1e-5, atol=1e-5)


def test_bad_verify_requests_are_refused():
    model = fuse_projections(random_model(tiny_config(), seed=14))
    cache = KVCache(model.cfg, 1, 8)
    rope = RopeTable(model.cfg.head_dim, model.cfg.rope_theta, 8, "cpu")
    with pytest.raises(ValueError, match="batch-1"):
        forward_verify(model, torch.tensor([[1, 2], [3, 4]]), cache, rope)
    with pytest.raises(ValueError, match="holds 8 positions; this step needs 9"):
        forward_verify(model, torch.tensor([list(range(9))]), cache, rope)
    model.layers[0].attn.wo.bias = nn.Parameter(torch.zeros(model.cfg.dim))
    assert is_fused(model)                                         # the per-sequence check sees the bias
    with pytest.raises(ValueError, match="bias-free"):
        forward_verify(model, torch.tensor([[1, 2]]), cache, rope)


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


def test_the_faster_16bit_build_is_chosen_once_per_process_on_whole_steps(monkeypatch):
    """choose_16bit_build times whole first steps (every layer) with each build, keeps the faster for
    the rest of the process, and leaves no trace in the tokens. Stand-ins: the 'materialised' build is
    made slower by a sleep; both run decode_layer itself."""
    import time

    calls = []

    def build(name, delay):
        def run(*args):
            calls.append(name)
            time.sleep(delay)
            return fast_decode.decode_layer(*args)
        return run
    monkeypatch.setattr(fast_decode, "_compiled_decode_layer", build("default", 0.0))
    monkeypatch.setattr(fast_decode, "_compiled_decode_layer_16bit", build("materialised", 0.002))
    monkeypatch.setattr(fast_decode, "_chosen_16bit", {})
    model = fuse_projections(random_model(tiny_config(), seed=6, dtype=torch.bfloat16))
    prompt, n_new, n_layers = [5, 6, 7, 8], 5, model.cfg.n_layers
    chosen = generate_greedy_fast(model, prompt, n_new, compiled_step=True)
    kind = f"float dim={model.cfg.dim} layers={n_layers}"
    assert fast_decode.chosen_16bit_builds() == {kind: "default"}
    timed = (1 + fast_decode.CHOICE_ROUNDS) * n_layers                    # compile + timed rounds, whole steps
    assert calls.count("materialised") == timed
    assert calls.count("default") == timed + (n_new - 1) * n_layers      # then every decode step: the winner
    calls.clear()
    assert generate_greedy_fast(model, prompt, n_new, compiled_step=True) == chosen   # timing wrote nothing lasting
    assert calls == ["default"] * (n_new - 1) * n_layers                  # chosen once per process
    fp32 = fuse_projections(random_model(tiny_config(), seed=6))
    generate_greedy_fast(fp32, prompt, n_new, compiled_step=True)
    assert fast_decode.chosen_16bit_builds() == {kind: "default"}         # fp32 takes the default build untimed
    calls.clear()
    deeper = fuse_projections(random_model(tiny_config(n_layers=3), seed=6, dtype=torch.bfloat16))
    generate_greedy_fast(deeper, prompt, n_new, compiled_step=True)       # another shape: timed again
    assert len(fast_decode.chosen_16bit_builds()) == 2 and "materialised" in calls
