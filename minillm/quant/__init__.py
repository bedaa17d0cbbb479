"""Weight-only quantisation of a Llama's linear layers, from scratch.

    quantize_model(model, "int8")                         per-channel absmax, 8 bits
    quantize_model(model, "int4", group_size=128)         round-to-nearest, asymmetric by default
    quantize_model(model, "nf4", double_quant=True)       QLoRA's NormalFloat, block 64
    quantize_model(model, "gptq", calibration_ids=ids)    second-order error compensation
    quantize_model(model, "awq", calibration_ids=ids)     activation-aware scales + clipping

Every nn.Linear inside model.layers becomes a QuantLinear (minillm/quant/linear.py). The tied
embedding / LM head (49152 x 576, a fifth of SmolLM2's parameters) stays in full precision, as
in GPTQ's and AWQ's reference code, unless lm_head="int8" (what LLM does on a CPU): then the head
reads an int8 copy of its own. save_quantized / load_quantized store the result as
safetensors, so calibration runs once.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn

from . import int4, int8, nf4, w8a8
from .kv_fp8 import quantize_kv_fp8
from .linear import QuantLinear

METHODS = ("int8", "int4", "nf4", "gptq", "awq", "w8a8", "fp8")
CALIBRATION_WINDOWS = 8        # token windows of calibration_text() used by GPTQ / AWQ
# LLM(quantization=...): GPTQ over-fits its Hessians on 8 windows and loses to RTN on text of other
# domains; on 32 it beats RTN on all four of bench calibration's. AWQ gained nothing from 32 (lesson 04).
LLM_CALIBRATION_WINDOWS = {"gptq": 32, "awq": CALIBRATION_WINDOWS, "w8a8": CALIBRATION_WINDOWS}   # w8a8: SmoothQuant
CALIBRATION_WINDOW = 512       # tokens per window


FUSED = (("attn", "wqkv"), ("ffn", "w_gate_up"))   # minillm/stages/fast_decode.py's fused projections


def drop_fused_projections(model) -> None:
    """LLM fuses [wq; wk; wv] and [w_gate; w_up] into one matrix each for its fast decode path,
    with the separate modules as views (fast_decode.py). Quantisation works on the separate
    projections, so the fused full-precision copies are removed; fast_decode.is_fused(model) is
    then False and LLM runs the cached forward over the QuantLinears."""
    for block in model.layers:
        for parent, name in FUSED:
            if hasattr(block.get_submodule(parent), name):
                delattr(block.get_submodule(parent), name)


def linear_layers(model) -> dict[str, nn.Linear]:
    """Full-precision nn.Linear modules inside model.layers, by qualified name (fused ones excluded)."""
    fused = tuple(f"{parent}.{name}" for parent, name in FUSED)
    return {f"layers.{name}": m for name, m in model.layers.named_modules()
            if type(m) is nn.Linear and not name.endswith(fused)}


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` where model's submodule `name` (dotted, e.g. "layers.3.attn.wq" or, within a
    block, "attn.wq") is. The one way every quantiser swaps a layer."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, new)


def quantize_linear(linear: nn.Linear, method: str, *, bits: int = 4, group_size: int = 128,
                    symmetric: bool = False, double_quant: bool = False, block_size: int = 64) -> QuantLinear:
    """Data-free (RTN-style) quantisation of one layer: int8, int4 (3 or 4 bits), nf4, fp8 (e4m3, one scale
    per output channel) or w8a8 (its weight; the activation is quantised at run time)."""
    w = linear.weight.detach()
    if method == "int8":
        return QuantLinear.from_linear(linear, "int8", int8.quantize(w))
    if method == "w8a8":
        return QuantLinear.from_linear(linear, "w8a8", w8a8.quantize(w))
    if method == "fp8":
        q, scale = quantize_kv_fp8(w)                      # each row of W as kv_fp8 does each token: max|row| -> 448
        return QuantLinear.from_linear(linear, "fp8", {"bits": q, "scale": scale})
    if method == "int4":
        return QuantLinear.from_linear(linear, "int", int4.quantize(w, bits, group_size, symmetric),
                                       {"bits": bits, "group_size": group_size})
    if method == "nf4":
        return QuantLinear.from_linear(linear, "nf4", nf4.quantize(w, block_size, double_quant),
                                       {"block": block_size})
    raise ValueError(f"method = {method!r} has no data-free quantiser; allowed: 'int8', 'int4', 'nf4', 'w8a8', 'fp8'")


def _check_args(model, method, bits, group_size, calibration_ids):
    if method not in METHODS:
        raise ValueError(f"quantization method {method!r} is unknown; allowed: {', '.join(METHODS)}")
    layers = linear_layers(model)
    if not layers:
        raise ValueError("model.layers holds no full-precision nn.Linear: is it already quantised?")
    if method in ("int4", "gptq", "awq"):
        int4.check_bits(bits)
        int4.check_group_size(group_size)
    if method in ("gptq", "awq") and calibration_ids is None:
        raise ValueError(f"method {method!r} needs calibration_ids: token windows (N, T) of calibration text, "
                         f"e.g. quant.calibration_windows(tokenizer)")


LM_HEAD_FORMATS = (None, "int8", "w8a8")


@torch.no_grad()
def quantize_model(model, method: str, *, bits: int = 4, group_size: int = 128, symmetric: bool = False,
                   double_quant: bool = False, calibration_ids=None, lm_head: str | None = None, **kw):
    """Replace every nn.Linear in model.layers by a QuantLinear, in place; returns the model.

    bits, group_size, symmetric: for int4 (RTN), gptq and awq (bits 3 or 4).
    double_quant, block_size (kw, default 64): for nf4.
    calibration_ids: (N, T) token ids for gptq / awq (required) and w8a8 (optional: SmoothQuant first); kw go
    to gptq.quantize_model_gptq / awq.quantize_model_awq / w8a8.quantize_model_w8a8 (e.g. act_order,
    blocksize, damp; n_grid; alpha).
    lm_head: None keeps the LM head in full precision; "int8" gives it an int8 copy of its own, "w8a8" a
    W8A8 one (quantize_lm_head)."""
    _check_args(model, method, bits, group_size, calibration_ids)
    if lm_head not in LM_HEAD_FORMATS:
        raise ValueError(f"lm_head = {lm_head!r}; allowed: None (full precision), 'int8' or 'w8a8'")
    drop_fused_projections(model)
    if lm_head is not None:
        quantize_lm_head(model, lm_head)
    if method == "gptq":
        from .gptq import quantize_model_gptq
        return quantize_model_gptq(model, as_ids(calibration_ids, model), bits=bits, group_size=group_size,
                                   symmetric=symmetric, **kw)
    if method == "w8a8":                                  # smoothed first where calibration ids are given
        return w8a8.quantize_model_w8a8(model, None if calibration_ids is None else as_ids(calibration_ids, model), **kw)
    if method == "awq":
        from .awq import quantize_model_awq
        return quantize_model_awq(model, as_ids(calibration_ids, model), bits=bits, group_size=group_size,
                                  symmetric=symmetric, **kw)
    for name, linear in linear_layers(model).items():
        replace_module(model, name, quantize_linear(linear, method, bits=bits, group_size=group_size,
                                                    symmetric=symmetric, double_quant=double_quant, **kw))
    return model


def quantize_lm_head(model, fmt: str = "int8") -> None:
    """The LM head as an int8 QuantLinear (per-row absmax): weight-only ("int8") or, for a W8A8 model,
    "w8a8" (the final hidden state quantised per token too, so that a batch's logits are an int8 GEMM).
    With tied embeddings (SmolLM2) the head is the embedding matrix, a fifth of the parameters and the
    largest single read of a decode step; the embedding lookup keeps the full-precision matrix (one row
    per token: no bandwidth to save), the head reads the int8 copy. llama.cpp's 4-bit files likewise keep
    the output matrix at 6-8 bits."""
    if isinstance(model.lm_head, QuantLinear):
        return
    head = model.lm_head
    if head is None:                                                       # tied: the embedding's matrix
        head = nn.Linear(model.cfg.dim, model.cfg.vocab_size, bias=False, device="meta")
        head.weight = nn.Parameter(model.embed.weight.detach(), requires_grad=False)
    model.lm_head = quantize_linear(head, fmt)


def as_ids(calibration_ids, model) -> torch.Tensor:
    """Token windows as a LongTensor (N, T) on the model's device."""
    ids = torch.as_tensor(calibration_ids, dtype=torch.long)
    if ids.dim() != 2 or ids.numel() == 0:
        raise ValueError(f"calibration_ids must be token windows shaped (N, T); got shape {tuple(ids.shape)}")
    return ids.to(model.embed.weight.device)


CALIBRATION_SOURCES = ("python-docs", "model-samples", "mixed")
SAMPLE_TEMPERATURE = 1.0       # model-samples: plain sampling from the model's own distribution
SAMPLE_TOP_P = 1.0


def calibration_windows(tokenizer, n_windows: int = CALIBRATION_WINDOWS, window: int = CALIBRATION_WINDOW, *,
                        source: str = "python-docs", model=None, seed: int = 0,
                        temperature: float = SAMPLE_TEMPERATURE, top_p: float = SAMPLE_TOP_P,
                        cache: bool = True) -> torch.Tensor:
    """(n_windows, window) token ids to calibrate GPTQ / AWQ on, from one source:

    "python-docs"    windows of evaluate.calibration_text(), which the evaluation never sees (default);
    "model-samples"  text the model writes itself (LLM-QAT's data-free idea): each window starts at the
                     tokenizer's BOS token and is sampled from `model` at `temperature` / `top_p`,
                     window i with its own generator seeded from (seed, i); generic, no download.
                     Cached under loader.cache_dir()/calibration (cache=False: always generate);
    "mixed"          n_windows - n_windows // 2 python-docs windows, then n_windows // 2 model samples.
    Deterministic: the same arguments (and model weights) give the same windows."""
    from minillm.evaluate import calibration_text, token_windows

    if source not in CALIBRATION_SOURCES:
        raise ValueError(f"calibration source {source!r} is unknown; allowed: {', '.join(map(repr, CALIBRATION_SOURCES))}")
    if isinstance(n_windows, bool) or not isinstance(n_windows, int) or n_windows < 1:
        raise ValueError(f"n_windows = {n_windows!r} is invalid; allowed: an integer >= 1")
    if source != "python-docs" and model is None:
        raise ValueError(f"calibration source {source!r} samples text from the model: pass model=<the Llama to quantise>")
    n_samples = {"python-docs": 0, "model-samples": n_windows, "mixed": n_windows // 2}[source]
    parts = []
    if n_windows - n_samples:
        docs = token_windows(tokenizer.encode(calibration_text()), window, n_windows - n_samples)
        parts.append(torch.tensor(docs))
    if n_samples:
        sample = cached_model_samples if cache else model_samples
        parts.append(sample(model, n_samples, window, start_token=start_token(tokenizer, model), seed=seed,
                            temperature=temperature, top_p=top_p))
    return torch.cat(parts)


def start_token(tokenizer, model) -> int:
    """The first token of every sampled window: the tokenizer's BOS, else its EOS, else id 0."""
    for name in ("bos_token_id", "eos_token_id"):
        token = getattr(tokenizer, name, None)
        if isinstance(token, int) and 0 <= token < model.cfg.vocab_size:
            return token
    return 0


@torch.no_grad()
def model_samples(model, n_windows: int, window: int, *, start_token: int = 0, seed: int = 0,
                  temperature: float = SAMPLE_TEMPERATURE, top_p: float = SAMPLE_TOP_P, batch: int = 16) -> torch.Tensor:
    """(n_windows, window) token ids the model samples after `start_token`, over a KV cache
    (kv_cache.forward_cached), `batch` windows at a time; EOS does not stop a window.
    Window i draws from its own torch.Generator seeded with seed * 1_000_003 + i."""
    from minillm.stages.kv_cache import KVCache, forward_cached
    from minillm.engine.sampling import SamplingParams, filtered_probs

    if window < 2:
        raise ValueError(f"window = {window} is invalid; allowed: an integer >= 2")
    params = SamplingParams(temperature=temperature, top_p=top_p)
    if params.greedy:
        raise ValueError("temperature = 0 would give every window the same greedy text; allowed: > 0")
    device = model.embed.weight.device
    out = torch.empty(n_windows, window, dtype=torch.long)
    for b0 in range(0, n_windows, batch):
        rows = range(b0, min(b0 + batch, n_windows))
        gens = [torch.Generator(device=device).manual_seed(seed * 1_000_003 + i) for i in rows]
        cache = KVCache(model.cfg, len(rows), window, model.embed.weight.dtype, device)
        tokens = torch.full((len(rows), 1), start_token, dtype=torch.long, device=device)     # (B, 1)
        out[b0:b0 + len(rows), 0] = start_token
        for t in range(1, window):
            logits = forward_cached(model, tokens, cache)                                     # (B, V)
            nxt = [int(torch.multinomial(filtered_probs(logits[j], params), 1, generator=g)) for j, g in enumerate(gens)]
            out[b0:b0 + len(rows), t] = torch.tensor(nxt)
            tokens = torch.tensor(nxt, device=device)[:, None]
    return out


def model_fingerprint(model) -> str:
    """A hash of the model's config and every tensor of its state dict (float copies differ)."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(model.cfg.to_dict(), sort_keys=True).encode())
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def cached_model_samples(model, n_windows: int, window: int, **kw) -> torch.Tensor:
    """model_samples, generated once per (model weights, arguments) and kept under
    loader.cache_dir()/calibration; a clean machine regenerates them."""
    from minillm.loading.loader import cache_dir

    key = _cache_key(model_fingerprint(model), n_windows, window, sorted(kw.items()))
    path = cache_dir() / "calibration" / f"model-samples-{key}.pt"
    if path.is_file():
        try:
            ids = torch.load(path, weights_only=True)
            if tuple(ids.shape) == (n_windows, window):
                return ids
        except Exception:                  # a partial or foreign file: generate again
            pass
    ids = model_samples(model, n_windows, window, **kw)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    torch.save(ids, tmp)
    tmp.replace(path)
    return ids


def _cache_key(*parts) -> str:
    import hashlib

    return hashlib.sha256(repr(parts).encode()).hexdigest()[:20]


# ---- sizes --------------------------------------------------------------------------------------

def weight_bytes(model) -> dict:
    """Bytes and bits per parameter of the linear layers in model.layers (scales included),
    and of the whole model (embedding, norms and all)."""
    linear_bytes = linear_params = 0
    for m in model.layers.modules():
        if isinstance(m, QuantLinear):
            linear_bytes += m.weight_bytes()
            linear_params += m.in_features * m.out_features
        elif type(m) is nn.Linear:
            linear_bytes += m.weight.numel() * m.weight.element_size()
            linear_params += m.weight.numel()
    other = sum(t.numel() * t.element_size() for name, t in model.state_dict().items()
                if not _is_linear_weight(model, name))
    return {"linear_bytes": linear_bytes, "linear_params": linear_params,
            "bits_per_param": 8 * linear_bytes / linear_params, "model_bytes": linear_bytes + other}


def decode_step_bytes(model) -> int:
    """Weight bytes one decode token reads: every linear layer of the blocks (packed codes and
    scales where quantised) and the LM head (the tied embedding when there is no separate head).
    Embedding rows and norms are left out: a token reads one row and a few vectors of them."""
    head = model.lm_head if model.lm_head is not None else model.embed
    head_bytes = head.weight_bytes() if isinstance(head, QuantLinear) else head.weight.numel() * head.weight.element_size()
    return weight_bytes(model)["linear_bytes"] + head_bytes


def _is_linear_weight(model, name: str) -> bool:
    module_name, _, attr = name.rpartition(".")
    if not module_name.startswith("layers."):
        return False
    m = model.get_submodule(module_name)
    return (isinstance(m, QuantLinear) and attr in m.tensor_names) or (type(m) is nn.Linear and attr == "weight")


# ---- save / load -------------------------------------------------------------------------------

def save_quantized(model, path) -> Path:
    """Everything needed to rebuild the quantised model (config, packed layers, norms, embedding)."""
    from safetensors.torch import save_file

    layers = {name: {"fmt": m.fmt, "in": m.in_features, "out": m.out_features, "params": m.params,
                     "tensors": list(m.tensor_names), "bias": m.bias is not None}
              for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    dtype = str(model.embed.weight.dtype).removeprefix("torch.")
    meta = {"config": model.cfg.to_dict(), "dtype": dtype, "quantized_layers": layers}
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"minillm_quant": json.dumps(meta)})
    return path


def load_quantized(model_or_cfg, path, device="cpu"):
    """Rebuild a quantised model from save_quantized's file. model_or_cfg: a Llama skeleton (its
    weights are replaced), a ModelConfig, or None (the config stored in the file)."""
    from safetensors import safe_open

    from minillm.model.llama import Llama, ModelConfig

    with safe_open(str(path), framework="pt") as f:
        raw = (f.metadata() or {}).get("minillm_quant")
        if raw is None:
            raise ValueError(f"{path} was not written by save_quantized (no 'minillm_quant' metadata)")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta = json.loads(raw)
    if model_or_cfg is None:
        model_or_cfg = ModelConfig(**meta["config"])
    model = Llama(model_or_cfg) if isinstance(model_or_cfg, ModelConfig) else model_or_cfg
    if model.cfg.to_dict() != meta["config"]:
        raise ValueError(f"the model's config does not match the one saved in {path}")
    model.to(getattr(torch, meta["dtype"]))
    for name, info in meta["quantized_layers"].items():
        qt = {t: tensors[f"{name}.{t}"] for t in info["tensors"]}
        bias = tensors.get(f"{name}.bias") if info["bias"] else None
        replace_module(model, name, QuantLinear(info["fmt"], info["in"], info["out"], qt, info["params"], bias))
    model.load_state_dict(tensors, strict=True)
    return model.to(device).eval()
