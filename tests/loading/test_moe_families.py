"""DeepSeek-V3 (multi-head latent attention + sigmoid-routed experts with a shared one) and Mixtral
(softmax-routed experts) through the one forward, each proven equal to transformers on a tiny
random-weight model made from the family's own config class (no download), saved as an HF folder."""
from __future__ import annotations

import pytest
import torch

from helpers import hf_folders, hf_greedy, tiny_hf_model
from minillm import LLM, SamplingParams
from minillm.attention.backends import make_backend
from minillm.loading.loader import load_model
from minillm.model.runner import GROUP_COST_BLOCKS

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=256, hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=6,
              max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False)
FAMILIES = {
    # 16 experts in 4 groups, 2 groups kept, top 4, one shared, the first layer dense (DeepSeek-V3's layout, small)
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
                    dict(moe_intermediate_size=32, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
                         n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=48, kv_lora_rank=32,
                         qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, routed_scaling_factor=2.5)),
    "deepseek_v3-no-q-lora": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
                              dict(moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=2,
                                   num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=0,
                                   q_lora_rank=None, kv_lora_rank=24, qk_rope_head_dim=16, qk_nope_head_dim=8,
                                   v_head_dim=24, norm_topk_prob=False)),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)),
}
TOLERANCE = 2e-4            # fp32 logits, both sides summing in their own order over 300 positions


def tiny_hf(family: str, **overrides):
    """A tiny random-weight transformers model of `family` (helpers.tiny_hf_model)."""
    config_class, model_class, extra = FAMILIES[family]
    return tiny_hf_model(config_class, model_class, {**COMMON, **extra, **overrides})


@pytest.fixture(scope="module")
def folders(tmp_path_factory, hf_tokenizer):
    """family -> (HF folder with config.json, safetensors and tokenizer, the transformers model)."""
    return hf_folders(tmp_path_factory, hf_tokenizer, {family: tiny_hf(family) for family in FAMILIES})


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, COMMON["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("T", [1, 37, 300])
@torch.no_grad()
def test_hf_folder_logits_equal_transformers(folders, family, T):
    folder, hf = folders[family]
    ours, _ = load_model(folder, dtype="float32", device="cpu")
    ids = torch.tensor([prompt(T, seed=T)])
    assert (ours(ids) - hf(ids).logits).abs().max().item() <= TOLERANCE


def test_what_each_family_changes_is_read_from_its_config(folders):
    ds = load_model(folders["deepseek_v3"][0], dtype="float32", device="cpu")[0]
    cfg = ds.cfg
    assert cfg.mla.kv_lora_rank == 32 and cfg.mla.q_lora_rank == 48 and cfg.head_dim == 8 == cfg.mla.qk_rope_head_dim
    assert (cfg.moe.router, cfg.moe.n_experts, cfg.moe.top_k, cfg.moe.n_group, cfg.moe.topk_group) == ("sigmoid", 16, 4, 4, 2)
    assert cfg.moe.n_shared == 1 and cfg.moe.routed_scale == 2.5 and cfg.moe.first_dense == 1
    hf_bias = folders["deepseek_v3"][1].model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(ds.layers[1].ffn.router_bias, hf_bias) and hf_bias.abs().sum() > 0
    assert type(ds.layers[0].ffn).__name__ == "FeedForward" and type(ds.layers[1].ffn).__name__ == "MoE"
    mx = load_model(folders["mixtral"][0], dtype="float32", device="cpu")[0].cfg
    assert mx.mla is None and (mx.moe.router, mx.moe.n_experts, mx.moe.top_k, mx.moe.n_shared) == ("softmax", 8, 2, 0)
    assert mx.n_kv_heads == 2 and not load_model(folders["deepseek_v3-no-q-lora"][0])[0].cfg.moe.norm_topk


def test_rotate_half_mla_rope_is_refused_by_name(tmp_path, hf_tokenizer):
    tiny_hf("deepseek_v3", rope_interleave=False).save_pretrained(tmp_path)
    hf_tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="rope_interleave=false"):
        load_model(tmp_path, dtype="float32", device="cpu")


def test_a_missing_expert_is_refused(tmp_path, folders):
    from safetensors.torch import load_file, save_file

    folder, _ = folders["mixtral"]
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    shard = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(str(shard))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w1.weight"]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="layers.1.ffn.w_gate is missing some experts"):
        load_model(tmp_path, dtype="float32", device="cpu")


# ---- through the engine: the latent paged cache, the experts in the one decoder layer ----------------




@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend", ["chosen", "torch"])
def test_engine_greedy_tokens_equal_transformers(folders, family, backend):
    """Batched, a lone request, then chunked prefill + prefix caching + preemption on a tiny pool: the same
    tokens as transformers' own greedy loop; an MLA model's pool holds one latent key per token and layer.
    backend: the one the engine chooses (an MLA cache: the compiled in-place decode kernel), or the reference."""
    folder, hf = folders[family]
    shared = prompt(24, seed=7)
    prompts = [prompt(5, seed=1), shared + prompt(9, seed=2), prompt(40, seed=3), shared + prompt(3, seed=4)]
    expected = hf_greedy(hf, prompts, 10)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(model=str(folder), dtype="float32", device="cpu", max_model_len=512, num_kv_blocks=256,
             tune_kernels=False) as llm:
        engine = llm.engine
        if backend == "torch":                                             # gather + SDPA, in groups by length
            engine.runner.attention = make_backend("torch", engine.kv, run_compiled=engine.runner._run)
            engine.decode_group_cost = GROUP_COST_BLOCKS
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
        one = llm.generate([{"prompt_token_ids": prompts[2]}], params, use_tqdm=False)[0]
        assert list(one.outputs[0].token_ids) == expected[2]
        if family.startswith("deepseek"):
            mla = llm.config.mla
            assert engine.kv.k.shape[-2:] == (1, mla.cache_width) and engine.kv.v.shape[-1] == mla.kv_lora_rank
            assert engine.kv.v.data_ptr() == engine.kv.k.data_ptr()                  # the values are a view
        if backend == "chosen" and family.startswith("deepseek"):
            assert engine.runner.attention.name == "cpu-fused" and engine.runner.attention.fused_calls > 0
    with LLM(model=str(folder), dtype="float32", device="cpu", max_model_len=64, block_size=4, num_kv_blocks=24,
             max_num_batched_tokens=16, enable_prefix_caching=True, tune_kernels=False) as llm:
        reqs = llm.make_requests([{"prompt_token_ids": p} for p in prompts], params)
        llm.engine.run(reqs)
        assert [r.output_token_ids for r in reqs] == expected
        assert sum(s["num_preempted"] for s in llm.engine.step_log) > 0
        assert max(r.num_cached_tokens for r in reqs) >= 20                   # the shared 24 tokens, whole blocks
        assert llm.engine.block_manager.num_free_blocks == 24                 # nothing leaked


def test_ngram_speculation_verifies_runs_over_the_latent_cache(folders):
    folder, hf = folders["deepseek_v3"]
    p = [5, 6, 7, 8, 9] * 8
    expected = hf_greedy(hf, [p], 20)[0]
    with LLM(model=str(folder), dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=64,
             speculative_method="ngram", num_speculative_tokens=3, speculative_policy="always",
             tune_kernels=False) as llm:
        reqs = llm.make_requests([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        llm.engine.run(reqs)
        assert reqs[0].output_token_ids == expected
        assert sum(s["num_draft_tokens"] for s in llm.engine.step_log) > 0


@pytest.mark.parametrize("option, named", [
    (dict(quantization="int8"), "quantization = 'int8'"), (dict(kv_cache_dtype="int8"), "kv_cache_dtype = 'int8'"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size = 2"), (dict(attention_backend="flash"), "'flash'"),
    (dict(speculative_method="layerskip"), "speculative_method = 'layerskip'")])
def test_what_the_engine_does_not_build_for_these_models_is_refused_by_name(folders, option, named):
    with pytest.raises(ValueError, match=f"MLA / mixture-of-experts model.*{named}"):
        LLM(model=str(folders["deepseek_v3"][0]), dtype="float32", device="cpu", max_model_len=128, **option)


@pytest.mark.parametrize("family", ["deepseek_v3", "mixtral"])
def test_engine_with_expert_parallel_2_equals_transformers(folders, family):
    """Two processes, each with half the routed experts, every MoE layer's rows split between them by all-to-all
    and gathered back; a lone request leaves one rank no rows in its share, and it still takes part."""
    folder, hf = folders[family]
    prompts = [prompt(6, seed=1), prompt(31, seed=2), prompt(3, seed=5)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(model=str(folder), dtype="float32", device="cpu", max_model_len=512, num_kv_blocks=256,
             expert_parallel_size=2) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        lone = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0]
        counts = llm.parallel.counts()
    expected = hf_greedy(hf, prompts, 8)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected and list(lone.outputs[0].token_ids) == expected[0]
    assert all(c["all_to_all.bytes"] > 0 and c["all_gather.calls"] > 0 for c in counts)


def test_expert_parallel_sizes_that_cannot_work_are_refused(folders):
    with pytest.raises(ValueError, match="does not split 16 experts evenly; allowed: 1, 2, 4, 8, 16"):
        LLM(model=str(folders["deepseek_v3"][0]), dtype="float32", device="cpu", max_model_len=128,
            expert_parallel_size=3)
    with pytest.raises(ValueError, match="expert_parallel_size = 2 with tensor_parallel_size|tensor_parallel_size = 2 with expert"):
        LLM(model=str(folders["deepseek_v3"][0]), device="cpu", tensor_parallel_size=2, expert_parallel_size=2)
