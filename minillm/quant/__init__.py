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

from . import int4, int8, nf4
from .linear import QuantLinear

METHODS = ("int8", "int4", "nf4", "gptq", "awq")
CALIBRATION_WINDOWS = 8        # token windows of calibration_text() used by GPTQ / AWQ
CALIBRATION_WINDOW = 512       # tokens per window


FUSED = (("attn", "wqkv"), ("ffn", "w_gate_up"))   # minillm/fast_decode.py's fused projections


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
    """Data-free (RTN-style) quantisation of one layer: int8, int4 (3 or 4 bits) or nf4."""
    w = linear.weight.detach()
    if method == "int8":
        return QuantLinear.from_linear(linear, "int8", int8.quantize(w))
    if method == "int4":
        return QuantLinear.from_linear(linear, "int", int4.quantize(w, bits, group_size, symmetric),
                                       {"bits": bits, "group_size": group_size})
    if method == "nf4":
        return QuantLinear.from_linear(linear, "nf4", nf4.quantize(w, block_size, double_quant),
                                       {"block": block_size})
    raise ValueError(f"method = {method!r} has no data-free quantiser; allowed: 'int8', 'int4', 'nf4'")


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


LM_HEAD_FORMATS = (None, "int8")


@torch.no_grad()
def quantize_model(model, method: str, *, bits: int = 4, group_size: int = 128, symmetric: bool = False,
                   double_quant: bool = False, calibration_ids=None, lm_head: str | None = None, **kw):
    """Replace every nn.Linear in model.layers by a QuantLinear, in place; returns the model.

    bits, group_size, symmetric: for int4 (RTN), gptq and awq (bits 3 or 4).
    double_quant, block_size (kw, default 64): for nf4.
    calibration_ids: (N, T) token ids for gptq / awq; kw go to gptq.quantize_model_gptq /
    awq.quantize_model_awq (e.g. act_order, blocksize, damp; n_grid).
    lm_head: None keeps the LM head in full precision; "int8" gives it an int8 copy of its own
    (quantize_lm_head)."""
    _check_args(model, method, bits, group_size, calibration_ids)
    if lm_head not in LM_HEAD_FORMATS:
        raise ValueError(f"lm_head = {lm_head!r}; allowed: None (full precision) or 'int8'")
    drop_fused_projections(model)
    if lm_head == "int8":
        quantize_lm_head(model)
    if method == "gptq":
        from .gptq import quantize_model_gptq
        return quantize_model_gptq(model, as_ids(calibration_ids, model), bits=bits, group_size=group_size,
                                   symmetric=symmetric, **kw)
    if method == "awq":
        from .awq import quantize_model_awq
        return quantize_model_awq(model, as_ids(calibration_ids, model), bits=bits, group_size=group_size,
                                  symmetric=symmetric, **kw)
    for name, linear in linear_layers(model).items():
        replace_module(model, name, quantize_linear(linear, method, bits=bits, group_size=group_size,
                                                    symmetric=symmetric, double_quant=double_quant, **kw))
    return model


def quantize_lm_head(model) -> None:
    """The LM head as an int8 QuantLinear (per-row absmax). With tied embeddings (SmolLM2) the head
    is the embedding matrix, a fifth of the parameters and the largest single read of a decode step;
    the embedding lookup keeps the full-precision matrix (one row per token: no bandwidth to save),
    the head reads the int8 copy. llama.cpp's 4-bit files likewise keep the output matrix at 6-8 bits."""
    if isinstance(model.lm_head, QuantLinear):
        return
    head = model.lm_head
    if head is None:                                                       # tied: the embedding's matrix
        head = nn.Linear(model.cfg.dim, model.cfg.vocab_size, bias=False, device="meta")
        head.weight = nn.Parameter(model.embed.weight.detach(), requires_grad=False)
    model.lm_head = quantize_linear(head, "int8")


def as_ids(calibration_ids, model) -> torch.Tensor:
    """Token windows as a LongTensor (N, T) on the model's device."""
    ids = torch.as_tensor(calibration_ids, dtype=torch.long)
    if ids.dim() != 2 or ids.numel() == 0:
        raise ValueError(f"calibration_ids must be token windows shaped (N, T); got shape {tuple(ids.shape)}")
    return ids.to(model.embed.weight.device)


def calibration_windows(tokenizer, n_windows: int = CALIBRATION_WINDOWS, window: int = CALIBRATION_WINDOW) -> torch.Tensor:
    """(n_windows, window) token ids from evaluate.calibration_text(), which the evaluation never sees."""
    from ..evaluate import calibration_text, token_windows

    return torch.tensor(token_windows(tokenizer.encode(calibration_text()), window, n_windows))


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

    from ..model import Llama, ModelConfig

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
