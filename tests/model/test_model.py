"""The naive baseline against transformers: same logits, same greedy tokens, HF folders load."""
import pytest
import torch

from minillm import SamplingParams
from minillm.loading.loader import load_model
from minillm.model.llama import (
                                 ATTENTION_BACKENDS, Llama, attention_function, naive_attention_fp32, random_model, tiny_config,
                                 )


def _tokens(n, seed=0, vocab=49152):
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [1, 7, 64, 300])
@torch.no_grad()
def test_logits_match_transformers(llm, hf_model, n):
    ids = _tokens(n, seed=n)
    ours = llm.model(ids)                                    # (1, n, V)
    ref = hf_model(ids).logits
    assert (ours - ref).abs().max().item() <= 1e-3


@torch.no_grad()
def test_32_greedy_tokens_match_transformers(llm, hf_model):
    prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "Tell me about the Moon."}])
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)[0]
    ids = torch.tensor([out.prompt_token_ids])
    ref = hf_model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, ids.shape[1]:]
    assert out.outputs[0].token_ids == ref.tolist()


def test_attention_is_causal_and_gqa_shapes():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, H, 5, 8, generator=gen) for H in (6, 2, 2))   # (B, H, T, D)
    out = naive_attention_fp32(q, k, v)
    assert out.shape == (2, 6, 5, 8)
    # the first query sees only the first key: its output is that key's value (for its group)
    assert torch.allclose(out[:, 0, 0], v[:, 0, 0], atol=1e-6)
    assert torch.allclose(out[:, 5, 0], v[:, 1, 0], atol=1e-6)
    # changing a later key must not change earlier outputs
    k2 = k.clone()
    k2[:, :, -1] += 1.0
    assert torch.equal(naive_attention_fp32(q, k2, v)[:, :, :-1], out[:, :, :-1])


@pytest.mark.parametrize("T,S", [(5, 5), (3, 8), (1, 6)])
def test_every_attention_backend_computes_the_same_attention(T, S):
    """The T queries are the last T of S positions (a prefill after a cached prefix when T < S):
    each backend of the one vocabulary gives naive_attention_fp32's output, GQA 3:1."""
    gen = torch.Generator().manual_seed(T * 10 + S)
    q = torch.randn(2, 6, T, 16, generator=gen)                           # (B, Hq, T, D)
    k, v = (torch.randn(2, 2, S, 16, generator=gen) for _ in range(2))     # (B, Hkv, S, D)
    ref = naive_attention_fp32(q, k, v)
    for backend in ATTENTION_BACKENDS:
        torch.testing.assert_close(attention_function(backend)(q, k, v, causal=True), ref, atol=1e-5, rtol=1e-5)


def test_an_unknown_attention_backend_is_refused_by_one_check_everywhere(tiny_model):
    """Llama.forward, fast_decode.FastDecoder and LLM share one check, whose error names every allowed value."""
    from minillm import LLM
    from minillm.stages.fast_decode import FastDecoder, fuse_projections

    cfg, ids = tiny_model.cfg, torch.tensor([[1, 2, 3]])
    fast_model = fuse_projections(random_model(cfg, seed=1))
    calls = (lambda: tiny_model(ids, attention_backend="xformers"),
             lambda: FastDecoder(fast_model, attention_backend="xformers"),
             lambda: LLM(model=tiny_model, attention_backend="xformers"))
    for call in calls:
        with pytest.raises(ValueError, match="'xformers' is not supported; allowed: 'naive' .*'sdpa' .*'flash'"):
            call()


def test_tiny_model_runs_and_is_deterministic(tiny_model):
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    a, b = tiny_model(ids), tiny_model(ids)
    assert a.shape == (2, 9, 256) and torch.equal(a, b)
    assert torch.isfinite(a).all() and a.std() > 0.1


def _hf_folder_from_tiny(tmp_path, arch, hf_tokenizer):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=256, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.eval().save_pretrained(tmp_path)
    hf_tokenizer.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@torch.no_grad()
def test_hf_folder_tiny_llama_and_qwen2(tmp_path, hf_tokenizer, arch):
    """HF's rotate-half q/k rows are permuted into our interleaved layout (and Qwen2's biases)."""
    hf = _hf_folder_from_tiny(tmp_path, arch, hf_tokenizer)
    ours, _ = load_model(tmp_path, dtype="float32", device="cpu")
    assert ours.cfg.qkv_bias == (arch == "qwen2")
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    assert (ours(ids) - hf(ids).logits).abs().max().item() <= 1e-4


@torch.no_grad()
def test_smollm2_saved_as_hf_folder_loads_with_identical_logits(tmp_path, llm, hf_model, hf_tokenizer):
    transformers = pytest.importorskip("transformers")
    config = hf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config      # GGUF-loaded models refuse save_pretrained otherwise
    plain = transformers.LlamaForCausalLM(config)
    plain.load_state_dict(hf_model.state_dict())
    plain.save_pretrained(tmp_path)
    hf_tokenizer.save_pretrained(tmp_path)
    ours, tok = load_model(tmp_path, dtype="float32", device="cpu")
    ids = _tokens(40, seed=3)
    assert torch.equal(ours(ids), llm.model(ids))
    assert tok.encode("Hello there, 123!") == llm.get_tokenizer().encode("Hello there, 123!")


def test_random_model_dtypes():
    m = random_model(tiny_config(), dtype=torch.bfloat16)
    assert isinstance(m, Llama) and m.embed.weight.dtype == torch.bfloat16
    assert m(torch.zeros(1, 4, dtype=torch.long)).dtype == torch.bfloat16


def test_a_shape_is_named_or_read_never_a_silent_default(smollm2_path):
    """ModelConfig has no default shape; ModelConfig.named finds the registry's (minillm/model/shapes.py), and the
    registry's SmolLM2 is the shape the loader reads from the GGUF this project runs."""
    from minillm.loading.gguf_file import read_gguf
    from minillm.loading.loader import config_from_gguf
    from minillm.model.llama import ModelConfig
    from minillm.model.shapes import SHAPES, SMOLLM2_135M

    with pytest.raises(TypeError, match="vocab_size"):
        ModelConfig()
    with pytest.raises(ValueError, match="unknown model shape 'smollm2'.*'smollm2-135m'"):
        ModelConfig.named("smollm2")
    assert ModelConfig.named("smollm2-135m") is SMOLLM2_135M and ModelConfig.named("llama3-8b") is SHAPES["llama3-8b"]
    gguf = read_gguf(smollm2_path)
    read = config_from_gguf(gguf.metadata, gguf.tensors.keys())
    assert read.replace(norm_eps=SMOLLM2_135M.norm_eps) == SMOLLM2_135M
    assert read.norm_eps == pytest.approx(SMOLLM2_135M.norm_eps)                # GGUF keeps it in float32
    assert SMOLLM2_135M.replace(n_kv_heads=9).n_kv_heads == 9 and SMOLLM2_135M.n_kv_heads == 3
