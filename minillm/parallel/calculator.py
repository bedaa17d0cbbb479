"""Time per decoded token on real hardware when one model is split over several GPUs.

Three costs per decode step of `batch` sequences (lesson 01's roofline, split N ways):
    compute   batch x FLOPs per token / (N x peak FLOP/s)
    weights   (weights + the batch's KV cache) / N / HBM bandwidth: each GPU reads its share
    comm      what the split sends over the link between GPUs

Tensor parallelism (N = t): every layer is split, so compute and weights shrink by t for ONE
token's latency, but each layer adds 2 all-reduces of (batch, dim). A ring all-reduce sends
2 (t - 1) / t x payload over each GPU's link, so comm = 2 L x 2 (t-1)/t x batch x dim x bytes / link.
Pipeline parallelism (N = p): each GPU holds L / p layers. One token still passes through all
p stages one after the other, so its latency is the one-GPU time plus (p - 1) activation sends of
(batch, dim); what grows is throughput: with p batches in flight every stage is busy (decode of
several batches needs no bubble once the pipeline is full), so tokens/s is p times one stage's.

The step time is compute-or-weights (whichever is slower) plus comm: no overlap assumed, and no
per-message latency (add latency_s, e.g. the gloo latency bench parallel measures, to see it;
2 L messages per token is why TP wants a fast, low-latency link).
"""
from __future__ import annotations

from minillm.model.llama import ModelConfig
from minillm.perf.roofline import GPUS, LLAMA3_70B, decode_bytes_per_step, decode_flops_per_token, kv_bytes_per_token, weight_bytes

# Published per-direction bandwidth of one GPU's link, bytes/s:
#   NVLink 4 (H100/H200 SXM): 900 GB/s per GPU, both directions together -> 450 GB/s each way
#   InfiniBand NDR: 400 Gb/s per port (one port per GPU in a DGX H100/H200) -> 50 GB/s each way
#   PCIe 5.0 x16: 32 GT/s x 16 lanes, 128b/130b coding -> about 63 GB/s each way
LINKS = {"NVLink 4": 450e9, "InfiniBand NDR": 50e9, "PCIe 5.0 x16": 63e9}
GPU_MEMORY = {"H100 SXM": 80e9, "H200": 141e9}      # published HBM capacity (NVIDIA datasheets)
GPUS_PER_NODE = 8                                   # DGX/HGX H100 and H200 boards


def tp_bytes_per_token(cfg: ModelConfig, dtype_bytes: float) -> float:
    """Payload all-reduced per token by the layers: 2 per layer (o_proj, down) of dim values."""
    return 2 * cfg.n_layers * cfg.dim * dtype_bytes


def pp_bytes_per_token(cfg: ModelConfig, stages: int, dtype_bytes: float) -> float:
    """Activations sent per token: one (dim,) vector across each of the stages - 1 boundaries."""
    return (stages - 1) * cfg.dim * dtype_bytes


def ep_bytes_per_token(cfg: ModelConfig, ranks: int, dtype_bytes: float) -> float:
    """Expert parallelism over `ranks`, routing even: what one token's rank sends per forward, through every
    MoE layer: its top_k rows, each (N-1)/N likely to belong on another rank, go out (dispatch) and come back
    (combine) as dim values each (parallel/expert.py)."""
    moe = cfg.moe
    layers = sum(moe.is_moe_layer(i) for i in range(cfg.n_layers))
    return 2 * layers * moe.top_k * (ranks - 1) / ranks * cfg.dim * dtype_bytes


def ring_all_reduce_seconds(payload: float, ranks: int, link: str, latency_s: float = 0.0) -> float:
    """Time of one ring all-reduce of `payload` bytes: each GPU sends 2 (N-1)/N x payload."""
    if ranks == 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * payload / LINKS[link] + latency_s


def _compute_and_weights(cfg: ModelConfig, gpu: str, share: float, batch: int, context: int,
                         dtype_bytes: float) -> tuple[float, float]:
    """Seconds of FLOPs and of HBM reads for `share` of the model (1/N of it) in one decode step."""
    flops = batch * decode_flops_per_token(cfg, context) * share
    nbytes = decode_bytes_per_step(cfg, dtype_bytes, context, batch) * share   # of the embedding, the batch's rows
    return flops / GPUS[gpu]["flops"], nbytes / GPUS[gpu]["bandwidth"]


def fits(cfg: ModelConfig, gpu: str, gpus: int, batch: int, context: int, dtype_bytes: float) -> bool:
    """Weights and the batch's KV cache fit in the GPUs' memory together (activations ignored)."""
    need = weight_bytes(cfg, dtype_bytes) + batch * context * kv_bytes_per_token(cfg, dtype_bytes)
    return need <= gpus * GPU_MEMORY[gpu]


def tensor_parallel_step(cfg: ModelConfig, gpu: str, tp: int, batch: int = 1, context: int = 0,
                         dtype_bytes: float = 2, link: str | None = None, latency_s: float = 0.0) -> dict:
    """One decode step with tp-way tensor parallelism. link: NVLink inside a node (tp <= 8), InfiniBand beyond."""
    link = link or ("NVLink 4" if tp <= GPUS_PER_NODE else "InfiniBand NDR")
    compute, weights = _compute_and_weights(cfg, gpu, 1 / tp, batch, context, dtype_bytes)
    calls = 2 * cfg.n_layers
    comm = calls * ring_all_reduce_seconds(batch * cfg.dim * dtype_bytes, tp, link, latency_s)
    step = max(compute, weights) + comm
    return {"mode": "TP", "gpus": tp, "link": link, "compute_s": compute, "weights_s": weights, "comm_s": comm,
            "token_latency_s": step, "tokens_per_s": batch / step, "messages_per_step": calls if tp > 1 else 0,
            "fits": fits(cfg, gpu, tp, batch, context, dtype_bytes)}


def pipeline_parallel_step(cfg: ModelConfig, gpu: str, pp: int, batch: int = 1, context: int = 0,
                           dtype_bytes: float = 2, link: str = "InfiniBand NDR", latency_s: float = 0.0) -> dict:
    """Decode with pp stages and pp batches of `batch` in flight. The latency of one token is every
    stage in turn plus pp - 1 sends; with every stage always busy, a batch of tokens leaves the
    last stage once per stage time (+ its send): tokens/s = batch / (stage + send), ~pp x one GPU's."""
    compute, weights = _compute_and_weights(cfg, gpu, 1 / pp, batch, context, dtype_bytes)
    send = batch * cfg.dim * dtype_bytes / LINKS[link] + latency_s if pp > 1 else 0.0
    stage = max(compute, weights)
    latency = pp * stage + (pp - 1) * send
    return {"mode": "PP", "gpus": pp, "link": link, "compute_s": compute * pp, "weights_s": weights * pp,
            "comm_s": (pp - 1) * send, "token_latency_s": latency, "tokens_per_s": batch / (stage + send),
            "messages_per_step": pp - 1, "fits": fits(cfg, gpu, pp, pp * batch, context, dtype_bytes)}


def table(cfg: ModelConfig = LLAMA3_70B, gpu: str = "H200", sizes=range(1, 9), batch: int = 1, context: int = 0,
          dtype_bytes: float = 2, pp_link: str = "InfiniBand NDR") -> list[dict]:
    """TP and PP rows for each size (TP over NVLink inside the node, PP over pp_link)."""
    return ([tensor_parallel_step(cfg, gpu, n, batch, context, dtype_bytes) for n in sizes]
            + [pipeline_parallel_step(cfg, gpu, n, batch, context, dtype_bytes, pp_link) for n in sizes])
