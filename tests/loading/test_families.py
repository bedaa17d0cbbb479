"""Model families through the one forward, each proven equal to transformers on a tiny random-weight
model made from the family's own config class (no download), saved as an HF folder and as a GGUF file.

    llama        Llama-2 / SmolLM2: the layer every other family changes
    llama3       Llama-3.1 / 3.2's "llama3" RoPE scaling (frequencies below a band divided by `factor`)
    llama-tied   tied embeddings (Llama-3.2-1B / 3B)
    mistral      Mistral without a sliding window (v0.3 and later), and with one (v0.1: each token attends
                 to the last W; the engine gives back the blocks that fall out of every window)
    qwen2        biases on q, k and v
    qwen3        RMSNorm on each head of q and k, head_dim decoupled from hidden / heads
"""
from __future__ import annotations

import json

import pytest
import torch

from helpers import hf_folders, hf_greedy, tiny_hf_model
from minillm import LLM, SamplingParams
from minillm.loading.loader import load_model, rotate_half_to_interleaved
from minillm.model.positions import rope_frequencies
from minillm.stages.fast_decode import FastDecoder

transformers = pytest.importorskip("transformers")

WINDOW = 32                 # Mistral-7B v0.1's 4,096 scaled down: prompts of 300 tokens slide past it
COMMON = dict(vocab_size=256, hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama3": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(rope_parameters=LLAMA3_ROPE)),
    "llama-tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=None)),
    "mistral-window": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=WINDOW)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32)),
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
    cfgs = {family: load_model(folder, dtype="float32", device="cpu")[0].cfg for family, (folder, _) in folders.items()}
    assert cfgs["qwen2"].qkv_bias and not cfgs["qwen3"].qkv_bias and not cfgs["llama"].qkv_bias
    assert cfgs["qwen3"].qk_norm and cfgs["qwen3"].head_dim == 32 and cfgs["qwen3"].n_heads * 32 != cfgs["qwen3"].dim
    assert cfgs["llama3"].rope_scaling == {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    assert cfgs["llama-tied"].tie_embeddings and not cfgs["llama"].tie_embeddings
    assert all(c.rope_scaling is None for f, c in cfgs.items() if f != "llama3")
    assert cfgs["mistral-window"].sliding_window == WINDOW and cfgs["mistral"].sliding_window is None


def test_llama3_scaling_changes_only_the_low_frequencies():
    """Wavelengths under original_max_position_embeddings / high_freq_factor keep their frequency,
    those over original / low_freq_factor are divided by factor, the band between is blended."""
    base = rope_frequencies(16, 10000.0)
    scaled = rope_frequencies(16, 10000.0, scaling=LLAMA3_ROPE)
    wavelength = 2 * torch.pi / base
    short, long = wavelength < 64 / 4, wavelength > 64 / 1
    assert torch.equal(scaled[short], base[short]) and short.any()
    assert torch.allclose(scaled[long], base[long] / 8) and long.any()
    middle = ~short & ~long
    assert middle.any() and ((scaled[middle] < base[middle]) & (scaled[middle] > base[middle] / 8)).all()


@pytest.mark.parametrize("family", ["llama", "llama-tied", "llama3", "qwen2", "qwen3", "mistral", "mistral-window"])
def test_engine_greedy_tokens_equal_transformers(folders, family):
    """Batched, then chunked prefill + prefix caching + preemption on a tiny pool: the same tokens
    as transformers' own greedy loop."""
    folder, hf = folders[family]
    shared = prompt(24, seed=7)
    prompts = [prompt(5, seed=1), shared + prompt(9, seed=2), prompt(40, seed=3), shared + prompt(3, seed=4)]
    expected = hf_greedy(hf, prompts, 10)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(model=str(folder), dtype="float32", device="cpu", max_model_len=512, num_kv_blocks=256,
             tune_kernels=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
        one = llm.generate([{"prompt_token_ids": prompts[2]}], params, use_tqdm=False)[0]
        assert list(one.outputs[0].token_ids) == expected[2]
        # a lone request decodes on the compiled step (Qwen2's biases keep it on the eager one)
        assert (llm.engine.runner.compiled_decode_steps > 0) == (family != "qwen2")
    with LLM(model=str(folder), dtype="float32", device="cpu", max_model_len=64, block_size=4, num_kv_blocks=24,
             max_num_batched_tokens=16, enable_prefix_caching=True, tune_kernels=False) as llm:
        reqs = llm.make_requests([{"prompt_token_ids": p} for p in prompts], params)
        llm.engine.run(reqs)
        assert [r.output_token_ids for r in reqs] == expected
        assert sum(s["num_preempted"] for s in llm.engine.step_log) > 0
        assert max(r.num_cached_tokens for r in reqs) >= 20                   # the shared 24 tokens, whole blocks
        assert llm.engine.block_manager.num_free_blocks == 24                 # nothing leaked


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3", "mistral-window"])
def test_engine_with_tensor_parallel_2_equals_transformers(folders, family):
    folder, hf = folders[family]
    prompts = [prompt(6, seed=1), prompt(31, seed=2)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(model=str(folder), dtype="float32", device="cpu", max_model_len=512, num_kv_blocks=256,
             tensor_parallel_size=2) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(hf, prompts, 8)


def test_lesson_02_stage_runs_a_qk_norm_model_on_the_baseline(folders):
    folder, hf = folders["qwen3"]
    model, _ = load_model(folder, dtype="float32", device="cpu")
    decoder = FastDecoder(model)
    assert decoder.kind == "baseline" and decoder.decode_weights is None
    p = prompt(11, seed=5)
    assert decoder.generate_greedy(p, 6) == hf_greedy(hf, [p], 6)[0]


# ---- GGUF: the same weights written with the gguf package -----------------------------------------

GGUF_ARCH = {"llama": "llama", "llama3": "llama", "llama-tied": "llama", "mistral": "llama", "mistral-window": "llama",
             "qwen2": "qwen2", "qwen3": "qwen3"}
GGUF_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
              "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
              "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
              "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
              "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
              "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
              "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def write_gguf(path, family: str, hf, tokens: list[str], merges: list[str], **extra_meta) -> None:
    """hf's weights as llama.cpp's converter lays them out: Llama-architecture q/k rows permuted to
    interleaved pairs, Qwen ones left rotate-half (NEOX); Llama 3's scaling as a rope_freqs tensor."""
    import gguf

    c, arch = hf.config, GGUF_ARCH[family]
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    if getattr(c, "sliding_window", None) is not None:
        writer.add_sliding_window(c.sliding_window)
    for key, value in extra_meta.items():
        getattr(writer, f"add_{key}")(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(2)
    tensors = {}
    for name, t in hf.state_dict().items():
        t = t.float()
        if name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = t
        elif name == "model.norm.weight":
            tensors["output_norm.weight"] = t
        elif name == "lm_head.weight":
            if not c.tie_word_embeddings:
                tensors["output.weight"] = t
        else:
            _, _, i, rest = name.split(".", 3)
            if arch == "llama" and rest.startswith(("self_attn.q_proj", "self_attn.k_proj")):
                heads = c.num_attention_heads if "q_proj" in rest else c.num_key_value_heads
                t = rotate_half_to_interleaved(t, heads)
            tensors[f"blk.{i}.{GGUF_NAMES[rest]}"] = t
    if c.rope_parameters.get("rope_type") == "llama3":
        base = rope_frequencies(head_dim, c.rope_parameters["rope_theta"])
        tensors["rope_freqs.weight"] = base / rope_frequencies(head_dim, c.rope_parameters["rope_theta"],
                                                               scaling=dict(c.rope_parameters))
    for name, t in tensors.items():
        writer.add_tensor(name, t.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def vocab(smollm2_path):
    """A 256-token byte-level BPE vocabulary for the tiny GGUF files (SmolLM2's first 256 tokens)."""
    from minillm.loading.gguf_file import read_gguf

    meta = read_gguf(smollm2_path).metadata
    tokens = meta["tokenizer.ggml.tokens"][:COMMON["vocab_size"]]
    kept = set(tokens)
    merges = [m for m in meta["tokenizer.ggml.merges"] if "".join(m.split(" ", 1)) in kept and
              all(part in kept for part in m.split(" ", 1))]
    return tokens, merges


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_gguf_of_the_same_weights_loads_to_the_same_logits(tmp_path, folders, vocab, family):
    _, hf = folders[family]
    path = tmp_path / f"{family}.gguf"
    write_gguf(path, family, hf, *vocab)
    ours, _ = load_model(path, dtype="float32", device="cpu")
    ids = torch.tensor([prompt(300, seed=9)])
    assert (ours(ids) - hf(ids).logits).abs().max().item() <= TOLERANCE
    if family == "llama3":
        assert ours.cfg.rope_scaling["rope_type"] == "freq_factors"


# ---- nothing silently wrong: what the forward does not implement is refused by name ------------------

@pytest.mark.parametrize("family, overrides, named", [
    ("qwen2", dict(use_sliding_window=True, sliding_window=64, max_window_layers=0), "sliding_window=64"),
    ("llama", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                    "original_max_position_embeddings": 128}), "'yarn'"),
    ("llama", dict(attention_bias=True), "attention_bias"),
    ("llama", dict(mlp_bias=True), "mlp_bias"),
    ("llama", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("qwen3", dict(attention_bias=True), "attention_bias"),
])
def test_config_fields_that_change_the_math_are_refused_by_name(tmp_path, hf_tokenizer, family, overrides, named):
    tiny_hf(family, **overrides).save_pretrained(tmp_path)
    hf_tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        load_model(tmp_path, dtype="float32", device="cpu")


def test_a_tensor_with_no_place_in_the_model_is_refused(tmp_path, folders):
    from safetensors.torch import load_file, save_file

    folder, _ = folders["llama"]
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    shard = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(str(shard))
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(COMMON["hidden_size"])
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="o_proj.bias has no place"):
        load_model(tmp_path, dtype="float32", device="cpu")


def test_an_unsupported_architecture_names_the_supported_ones(tmp_path, folders):
    folder, _ = folders["llama"]
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GemmaForCausalLM"]
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        load_model(tmp_path, dtype="float32", device="cpu")


def test_a_qwen_gguf_with_a_sliding_window_is_refused(tmp_path, folders, vocab):
    _, hf = folders["qwen2"]
    path = tmp_path / "windowed.gguf"
    write_gguf(path, "qwen2", hf, *vocab, sliding_window=64)
    with pytest.raises(ValueError, match="sliding_window=64"):
        load_model(path, dtype="float32", device="cpu")


# ---- loading as a user does it: a hub id from the local cache, sharded checkpoints --------------------

def test_a_hub_id_loads_from_the_local_hugging_face_cache(tmp_path, monkeypatch, folders):
    """The cache layout huggingface_hub writes: models--org--name/refs/main names the snapshot folder.
    Sharded, as large checkpoints are (model.safetensors.index.json + shards)."""
    folder, hf = folders["qwen3"]
    repo = tmp_path / "hub" / "models--Qwen--Qwen3-Tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    hf.save_pretrained(snapshot, max_shard_size="200KB")
    (snapshot / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    assert len(list(snapshot.glob("*.safetensors"))) > 1 and (snapshot / "model.safetensors.index.json").is_file()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    ours, _ = load_model("Qwen/Qwen3-Tiny", dtype="float32", device="cpu")
    ids = torch.tensor([prompt(20)])
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max().item() <= TOLERANCE
    next(snapshot.glob("model-00001-*.safetensors")).unlink()
    with pytest.raises(ValueError, match="shards the index lists are missing"):
        load_model("Qwen/Qwen3-Tiny", dtype="float32", device="cpu")


def test_a_hub_id_not_in_the_cache_fails_at_once_saying_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="not in the local Hugging Face cache.*models--Qwen--Qwen2.5-7B-Instruct.*"
                                         "hf download Qwen/Qwen2.5-7B-Instruct"):
        LLM(model="Qwen/Qwen2.5-7B-Instruct", device="cpu")


# ---- a sliding window in the paged engine ------------------------------------------------------------

def test_sliding_window_gives_back_the_blocks_that_fall_out_of_it(folders):
    """Mistral's window of W tokens: once decoding is past W, a request holds only the blocks of its last
    W positions (plus the one being written), and the tokens stay equal to transformers; a second request
    with the same prompt then hits the prefix cache, blocks outside its window included, equal again."""
    folder, hf = folders["mistral-window"]
    p, block_size, blocks = prompt(40, seed=11), 4, 64
    expected = hf_greedy(hf, [p, p[:36] + prompt(4, seed=12)], 60)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    with LLM(model=str(folder), dtype="float32", device="cpu", max_model_len=128, block_size=block_size,
             num_kv_blocks=blocks, enable_prefix_caching=True, tune_kernels=False) as llm:
        reqs = llm.make_requests([{"prompt_token_ids": p}], params)
        llm.engine.run(reqs)
        assert reqs[0].output_token_ids == expected[0]
        held = [blocks - s["free_blocks"] for s in llm.engine.step_log if s["num_decodes"]]
        assert max(held) <= WINDOW // block_size + 2 < (len(p) + 60) // block_size
        again = llm.make_requests([{"prompt_token_ids": p[:36] + prompt(4, seed=12)}], params)
        llm.engine.run(again)
        assert again[0].num_cached_tokens == 36 and again[0].output_token_ids == expected[1]
        assert llm.engine.block_manager.num_free_blocks == blocks


def test_a_windowed_model_speculates_exactly_and_refuses_the_backends_without_a_window(folders):
    """n-gram drafts verified as multi-token runs (the decode groups' masks carry the window)."""
    folder, hf = folders["mistral-window"]
    p = [5, 6, 7, 8, 9] * 8
    expected = hf_greedy(hf, [p], 30)[0]
    with LLM(model=str(folder), dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=64, speculative_method="ngram",
             num_speculative_tokens=3, speculative_policy="always", tune_kernels=False) as llm:
        reqs = llm.make_requests([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        llm.engine.run(reqs)
        assert reqs[0].output_token_ids == expected
        assert sum(s["num_draft_tokens"] for s in llm.engine.step_log) > 0
    with pytest.raises(ValueError, match="'flash' has no sliding window"):
        LLM(model=str(folder), dtype="float32", device="cpu", max_model_len=128, attention_backend="flash")
    model, _ = load_model(folder, dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="runs on the engine"):
        FastDecoder(model)


def test_a_windowed_prefix_hit_survives_the_eviction_of_blocks_outside_the_window(folders):
    """The pitfall of windowed models in a prefix cache: a request gives back its earliest blocks first (they
    leave the window), so under memory pressure they are evicted first, and a hash walk from the first
    block then finds nothing. The next token only needs the blocks of the last W positions: those are
    matched, the ones before come back as dropped, and the tokens stay equal to transformers."""
    folder, hf = folders["mistral-window"]
    first, block_size, blocks = prompt(40, seed=13), 4, 48
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(model=str(folder), dtype="float32", device="cpu", max_model_len=128, block_size=block_size,
             num_kv_blocks=blocks, enable_prefix_caching=True, tune_kernels=False) as llm:
        a = llm.make_requests([{"prompt_token_ids": first}], params)
        llm.engine.run(a)                                             # 79 tokens computed, early blocks given back
        other = llm.make_requests([{"prompt_token_ids": prompt(100, seed=14)}], params)
        llm.engine.run(other)                                         # needs the memory: evicts a's oldest blocks
        later = first + a[0].output_token_ids + prompt(4, seed=15)    # continues a's whole conversation
        bm = llm.engine.block_manager
        assert bm.prefix_cache.match(later, block_size) == []         # the walk from block 0 finds nothing
        b = llm.make_requests([{"prompt_token_ids": later}], params)
        llm.engine.run(b)
        assert b[0].num_cached_tokens == 76                        # a's 79 computed tokens, in whole blocks
        assert b[0].output_token_ids == hf_greedy(hf, [later], 40)[0]
        assert bm.num_free_blocks == blocks


@pytest.mark.parametrize("family", ["llama", "llama-tied"])
@torch.no_grad()
def test_save_hf_folder_writes_what_transformers_and_our_loader_read_back(tmp_path, folders, family):
    """loader.save_hf_folder, the inverse of loading a folder (bench peers hands vLLM our weights this way):
    transformers' logits from the written folder equal ours, and our loader reads it back to the same model."""
    from minillm.loading.loader import save_hf_folder

    ours, tokenizer = load_model(folders[family][0], dtype="float32", device="cpu")
    out = save_hf_folder(ours, tokenizer, tmp_path / "written")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    again, tokenizer_again = load_model(out, dtype="float32", device="cpu")
    ids = torch.tensor([prompt(37, seed=3)])
    assert (hf(ids).logits - ours(ids)).abs().max().item() <= TOLERANCE
    assert torch.equal(again(ids), ours(ids))
    assert tokenizer_again.encode("hello world") == tokenizer.encode("hello world")
    assert tokenizer_again.chat_template == tokenizer.chat_template


def test_save_hf_folder_refuses_what_it_would_drop(tmp_path, folders):
    from minillm.loading.loader import save_hf_folder

    model, tokenizer = load_model(folders["qwen2"][0], dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="qkv_bias"):
        save_hf_folder(model, tokenizer, tmp_path / "x")
