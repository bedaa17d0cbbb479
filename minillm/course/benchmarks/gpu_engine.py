"""Issue 26 section 3: the engine on GPU-sized models (random weights of published shapes), three numbers.

    python -m minillm bench gpu-engine [--quick] [--json results/gpu/gpu-engine.json]    (needs CUDA)

1. decode_bound     batch-1 greedy decode of a 7B-shaped bf16 model through LLM.generate and through
                    the engine (eager, and replaying CUDA graphs when LLM has enforce_eager), tokens/s
                    of the decode phase (1 / time per output token), against the HBM bound
                    copy bandwidth / (weight bytes + KV bytes read per token), the copy bandwidth
                    measured in the same run by kernel_timing.copy_bandwidth. Goal: >= 70% of it.
2. batching_vs_hf   one mixed workload (random prompt ids, log-uniform lengths, fixed seed) through our
                    continuous batching engine and through transformers' LlamaForCausalLM holding the
                    SAME weights (logits compared inside, max |diff| recorded), same dtype, same
                    maximum batch: padded batches, and one request at a time. Goals: >= 5x, >= 20x.
3. decode_vs_batch  one decode step of the engine's ModelRunner (ModelRunner.forward on a batch of
                    decode rows: a CUDA graph replay where the engine would replay one; no scheduling,
                    sampling or detokenising) at batch 1 .. 512, timed by kernel_timing.time_kernel;
                    where tokens/s stops growing linearly, next to the roofline's compute-bound batch
                    from the copy bandwidth and a bf16 matmul's FLOP/s, both measured in this run.

Every function takes (device, size arguments) and, for tests, `cfg`: a tiny ModelConfig that runs on CPU
in seconds. Timing: wall clock after a synchronize for whole generations (what a user waits for),
CUDA events (kernel_timing) for one step; every row says which.
"""
from __future__ import annotations

import gc
import inspect
import math
import statistics
import time

import numpy as np
import torch

from minillm.perf import roofline
from minillm.perf.kernel_timing import copy_bandwidth, time_kernel
from .common import document

NAME = "gpu-engine"
DTYPES = ("bfloat16", "float16", "float32")
DEFAULT_BATCHES = tuple(2**i for i in range(10))             # 1, 2, 4, ..., 512
GOALS = {"fraction_of_hbm_bound": 0.7, "continuous_vs_hf_padded": 5.0, "continuous_vs_hf_sequential": 20.0}
LINEAR = 0.8             # "still linear": tokens/s per row at least this share of the smallest batch's


class IdsTokenizer:
    """Token ids as text: random-weight models have no vocabulary (prompts are given as ids)."""
    eos_token_id = -1

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


# ---- shared pieces ----------------------------------------------------------------------------------

def check_device(name) -> torch.device:
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"device = {name!r} is not supported; allowed: 'cuda' or 'cpu'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device = 'cuda' but no CUDA device is available; allowed here: 'cpu' (with a tiny cfg)")
    return device


def check_positive(**values) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} = {value!r} is invalid; allowed: an integer >= 1")


def check_range(name: str, lo_hi) -> tuple[int, int]:
    lo, hi = lo_hi
    if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
        raise ValueError(f"{name} = {lo_hi!r} is invalid; allowed: (lo, hi) integers with 1 <= lo <= hi")
    return lo, hi


def make_model(shape: str, cfg, device: torch.device, dtype: str):
    """A random-weight model of a published shape (roofline.PUBLISHED), or of `cfg` (tests)."""
    from minillm.model.llama import random_model_on

    if dtype not in DTYPES:
        raise ValueError(f"dtype = {dtype!r} is not supported; allowed: {', '.join(map(repr, DTYPES))}")
    if cfg is None and shape not in roofline.PUBLISHED:
        raise ValueError(f"unknown shape {shape!r}; allowed: {', '.join(map(repr, roofline.PUBLISHED))}")
    cfg = roofline.PUBLISHED[shape] if cfg is None else cfg
    return random_model_on(cfg, device, getattr(torch, dtype))


def has_enforce_eager() -> bool:
    """LLM(enforce_eager=...) exists (CUDA graphs for decode steps); checked at call time."""
    from minillm import LLM
    return "enforce_eager" in inspect.signature(LLM.__init__).parameters


def make_llm(model, device, eager: bool | None = None, **engine_args):
    """An LLM around `model`; eager None: LLM's default (CUDA graphs where it has them)."""
    from minillm import LLM

    if eager is not None and has_enforce_eager():
        engine_args["enforce_eager"] = eager
    return LLM(model=model, tokenizer=IdsTokenizer(), device=str(device), **engine_args)


def graph_replays(llm) -> int:
    """Decode steps that replayed a CUDA graph in llm's engine (0 without graphs or an engine)."""
    engine = llm._engine
    return 0 if engine is None else int(getattr(engine.runner, "graph_replays", 0))


def free(device: torch.device) -> None:
    """LLM and engine hold each other (a cycle): collect them, then give their memory back."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def element_size(dtype: str) -> int:
    return torch.tensor([], dtype=getattr(torch, dtype)).element_size()


def matmul_flops(device: torch.device, dtype: str, n: int) -> dict:
    """FLOP/s of an n x n x n matmul in `dtype`, timed by kernel_timing.time_kernel."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=gen).to(getattr(torch, dtype))
    b = torch.randn(n, n, device=device, generator=gen).to(getattr(torch, dtype))
    timing = time_kernel(lambda: a @ b, device=device, samples=10, warmup=3)
    return {"flops_per_s": 2 * n**3 / timing["median_s"], "n": n, **timing}


# ---- 1. batch-1 decode against the HBM bound ------------------------------------------------------------

def decode_row(name: str, runs: list[dict], bound: float, new_tokens: int, reference: list[int]) -> dict:
    """One system's medians over its runs, and its fraction of the HBM bound (tokens/s)."""
    tpot = statistics.median(r["tpot"] for r in runs)
    wall = statistics.median(r["wall"] for r in runs)
    return {"system": name, "decode_tok_s": 1 / tpot, "end_to_end_tok_s": new_tokens / wall,
            "fraction_of_hbm_bound": (1 / tpot) / bound, "runs_tpot_ms": [1e3 * r["tpot"] for r in runs],
            "tokens_equal_to_generate": runs[0]["tokens"] == reference}


def decode_bound(device: str = "cuda", shape: str = "llama2-7b", new_tokens: int = 128, prompt_tokens: int = 16,
                 repeats: int = 3, copy_mbytes: int = 1024, cfg=None, dtype: str = "bfloat16") -> dict:
    """Batch-1 greedy decode: tokens/s of each system (median of `repeats` after a warm-up, interleaved)
    and its fraction of the HBM bound copy bandwidth / (weights + KV read per token)."""
    from .batching import run_engine

    device = check_device(device)
    check_positive(new_tokens=new_tokens, prompt_tokens=prompt_tokens, repeats=repeats, copy_mbytes=copy_mbytes)
    if new_tokens < 2:
        raise ValueError(f"new_tokens = {new_tokens} is too small; allowed: >= 2 (a decode phase needs two tokens)")
    free(device)
    label = shape if cfg is None else "custom"
    model = make_model(shape, cfg, device, dtype)
    cfg = model.cfg
    room = prompt_tokens + new_tokens + 1
    if room > cfg.max_seq_len:
        raise ValueError(f"prompt_tokens + new_tokens = {room - 1} exceed the model's {cfg.max_seq_len} positions")
    args = dict(max_model_len=room, max_num_seqs=1)
    graphs = device.type == "cuda" and has_enforce_eager()
    llms = {"generate": make_llm(model, device, **args), "engine_eager": make_llm(model, device, eager=True, **args)}
    if graphs:
        llms["engine_graphs"] = make_llm(model, device, eager=False, **args)
    prompt = torch.randint(3, cfg.vocab_size, (prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()

    def once(name: str) -> dict:
        """-> {"wall", "tpot"} of one generation through the system `name`."""
        from minillm import SamplingParams

        sync(device)
        t0 = time.perf_counter()
        if name == "generate":           # vLLM's call: LLM.generate decides the path (see "generate_path")
            out = llms[name].generate({"prompt_token_ids": prompt},
                                      SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True),
                                      use_tqdm=False)[0]
            tpot, tokens = out.metrics.time_per_output_token, out.outputs[0].token_ids
        else:
            r = run_engine(llms[name], [prompt], [new_tokens])
            tpot, tokens = r["tpot"][0], r["tokens"][0]
        sync(device)
        return {"wall": time.perf_counter() - t0, "tpot": tpot, "tokens": tokens}

    first = {name: once(name) for name in llms}                              # warm-up (records the graph)
    runs = {name: [] for name in llms}
    for r in range(repeats):
        for name in (list(llms) if r % 2 == 0 else list(llms)[::-1]):          # interleaved, alternating order
            runs[name].append(once(name))
    bandwidth = copy_bandwidth(device, copy_mbytes)
    elem = element_size(dtype)
    context = prompt_tokens + new_tokens // 2                                 # mean keys read per decode step
    bytes_per_token = roofline.decode_bytes_per_step(cfg, elem, context)
    bound = bandwidth["bytes_per_s"] / bytes_per_token
    rows = [decode_row(name, rs, bound, new_tokens, first["generate"]["tokens"]) for name, rs in runs.items()]
    engine = llms["generate"]._engine
    path = "engine" if engine is not None and len(engine.step_log) else "contiguous batch-1 path"
    best = max(rows, key=lambda r: r["decode_tok_s"])
    return {"shape": label, "dtype": dtype, "device": str(device), "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens, "repeats": repeats, "rows": rows, "generate_path": path,
            "graph_replays": {name: graph_replays(llm) for name, llm in llms.items()},
            "cuda_graphs_measured": graphs, "weight_bytes": roofline.weight_bytes(cfg, elem),
            "weight_bytes_read": roofline.weight_bytes_read(cfg, elem),
            "kv_bytes_per_token_read": context * roofline.kv_bytes_per_token(cfg, elem),
            "mean_context": context, "copy_bandwidth_GBps": bandwidth["bytes_per_s"] / 1e9,
            "copy_timing": bandwidth["method"], "hbm_bound_tok_s": bound,
            "best_system": best["system"], "best_fraction_of_hbm_bound": best["fraction_of_hbm_bound"],
            "timing": f"decode tok/s = 1 / time per output token (first token to last, time.time of each token), "
                      f"median of {repeats} runs after a warm-up run, systems interleaved; end_to_end_tok_s: "
                      f"new_tokens / wall clock (perf_counter after a synchronize) of the whole generate"}


# ---- 2. continuous batching vs transformers, same weights ----------------------------------------------

def interleaved_to_rotate_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Our q/k rows (RoPE pairs 2i, 2i + 1) in HF's rotate-half order (pairs i, i + hd/2): the
    inverse of loader.rotate_half_to_interleaved."""
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_twin(model):
    """transformers' LlamaForCausalLM with model's weights (q/k rows reordered for its RoPE), same
    dtype and device. No end-of-sequence token: every request runs for exactly the tokens it asks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = model.cfg
    weight = model.embed.weight
    config = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
                         num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                         num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps,
                         rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_seq_len,
                         tie_word_embeddings=cfg.tie_embeddings, attention_bias=cfg.qkv_bias,
                         bos_token_id=None, eos_token_id=None, pad_token_id=0)
    with torch.device(weight.device):             # initialised where it will run (a 1B fp32 init on CPU is slow)
        hf = LlamaForCausalLM(config)
    hf = hf.to(device=weight.device, dtype=weight.dtype).eval()
    state = {"model.embed_tokens.weight": weight, "model.norm.weight": model.norm.weight}
    if not cfg.tie_embeddings:
        state["lm_head.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.layers):
        a, f, p = layer.attn, layer.ffn, f"model.layers.{i}."
        state.update({p + "input_layernorm.weight": layer.attn_norm.weight,
                      p + "post_attention_layernorm.weight": layer.ffn_norm.weight,
                      p + "self_attn.q_proj.weight": interleaved_to_rotate_half(a.wq.weight, cfg.n_heads),
                      p + "self_attn.k_proj.weight": interleaved_to_rotate_half(a.wk.weight, cfg.n_kv_heads),
                      p + "self_attn.v_proj.weight": a.wv.weight, p + "self_attn.o_proj.weight": a.wo.weight,
                      p + "mlp.gate_proj.weight": f.w_gate.weight, p + "mlp.up_proj.weight": f.w_up.weight,
                      p + "mlp.down_proj.weight": f.w_down.weight})
        if cfg.qkv_bias:
            state.update({p + "self_attn.q_proj.bias": interleaved_to_rotate_half(a.wq.bias, cfg.n_heads),
                          p + "self_attn.k_proj.bias": interleaved_to_rotate_half(a.wk.bias, cfg.n_kv_heads),
                          p + "self_attn.v_proj.bias": a.wv.bias})
    missing, unexpected = hf.load_state_dict({k: v.detach() for k, v in state.items()}, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"HF twin: missing {missing}, unexpected {unexpected}")
    hf.generation_config.eos_token_id = None
    hf.generation_config.bos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


@torch.no_grad()
def logits_difference(model, hf, prompt: list[int]) -> dict:
    """max |ours - theirs| over the logits of every position of one prompt, and argmax agreement."""
    ids = torch.tensor([prompt], device=model.embed.weight.device)            # (1, T)
    ours, theirs = model(ids).float(), hf(ids).logits.float()                 # (1, T, V) each
    return {"max_abs_diff": (ours - theirs).abs().max().item(), "logits_abs_max": ours.abs().max().item(),
            "argmax_agreement": (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item(),
            "prompt_tokens": len(prompt)}


def random_workload(num_requests: int, prompt_range, output_range, vocab: int, seed: int = 0):
    """Prompts of random token ids and output lengths, both log-uniform in their ranges (as bench
    batching's make_workload, which needs a real tokenizer and text). -> (prompts, outputs)."""
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(*np.log(prompt_range), num_requests)).astype(int)
    outputs = np.exp(rng.uniform(*np.log(output_range), num_requests)).astype(int)
    prompts = [rng.integers(3, vocab, n).tolist() for n in lengths]
    return prompts, [int(o) for o in outputs]


@torch.no_grad()
def hf_generate(hf, prompts, outputs, batch_size: int) -> dict:
    """transformers' generate on left-padded batches of batch_size (1: one request at a time); each batch
    runs until its longest request is done. -> wall seconds, each request's tokens, rows x steps computed."""
    device = hf.device
    sync(device)
    t0 = time.perf_counter()
    tokens, computed = [], 0
    for first in range(0, len(prompts), batch_size):
        idx = range(first, min(first + batch_size, len(prompts)))
        longest = max(len(prompts[i]) for i in idx)
        ids = torch.zeros(len(idx), longest, dtype=torch.long)                # (b, longest), pad id 0, left
        mask = torch.zeros(len(idx), longest, dtype=torch.long)
        for b, i in enumerate(idx):
            ids[b, longest - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[b, longest - len(prompts[i]):] = 1
        steps = max(outputs[i] for i in idx)
        computed += len(idx) * steps
        gen = hf.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=steps, do_sample=False,
                          pad_token_id=0)
        tokens += [gen[b, longest:longest + outputs[i]].tolist() for b, i in enumerate(idx)]
    sync(device)
    return {"wall": time.perf_counter() - t0, "tokens": tokens, "useful": sum(outputs), "computed": computed}


def batching_vs_hf(device: str = "cuda", shape: str = "llama3.2-1b", num_requests: int = 32,
                   prompt_range=(16, 256), output_range=(16, 128), max_batch: int = 16, sequential_requests: int = 4,
                   repeats: int = 3, seed: int = 0, cfg=None, dtype: str = "bfloat16") -> dict:
    """Output tokens/s of the workload through our engine (continuous batching, max_num_seqs=max_batch)
    and transformers (padded batches of max_batch; one request at a time on the first
    `sequential_requests`), the same weights and dtype; medians of `repeats` interleaved runs."""
    from .batching import run_engine

    device = check_device(device)
    check_positive(num_requests=num_requests, max_batch=max_batch, sequential_requests=sequential_requests,
                   repeats=repeats)
    prompt_range, output_range = check_range("prompt_range", prompt_range), check_range("output_range", output_range)
    if sequential_requests > num_requests:
        raise ValueError(f"sequential_requests = {sequential_requests} > num_requests = {num_requests}; "
                         f"allowed: 1..num_requests")
    free(device)
    model = make_model(shape, cfg, device, dtype)
    cfg_used = model.cfg
    room = prompt_range[1] + output_range[1] + 1
    if room > cfg_used.max_seq_len:
        raise ValueError(f"prompt_range and output_range need {room} positions; the model has {cfg_used.max_seq_len}")
    prompts, outputs = random_workload(num_requests, prompt_range, output_range, cfg_used.vocab_size, seed)
    hf = hf_twin(model)
    check = logits_difference(model, hf, prompts[0][:32])
    llm = make_llm(model, device, max_model_len=room, max_num_seqs=max_batch,
                   num_kv_blocks=max_batch * math.ceil(room / 16), max_num_batched_tokens=2048)
    k = sequential_requests
    systems = {"continuous": lambda p, o: run_engine(llm, p, o),
               "hf_padded": lambda p, o: hf_generate(hf, p, o, max_batch),
               "hf_sequential": lambda p, o: hf_generate(hf, p[:k], o[:k], 1)}
    for fn in systems.values():                                               # warm-up, two short requests
        fn(prompts[:2], [4, 4])
    runs = {name: [] for name in systems}
    for r in range(repeats):
        for name in (list(systems) if r % 2 == 0 else list(systems)[::-1]):
            result = systems[name](prompts, outputs)
            sync(device)
            runs[name].append(result)
    useful = {"continuous": sum(outputs), "hf_padded": sum(outputs), "hf_sequential": sum(outputs[:k])}
    rows = []
    for name, rs in runs.items():
        walls = [r["wall"] for r in rs]
        row = {"system": name, "requests": num_requests if name != "hf_sequential" else k,
               "output_tokens": useful[name], "output_tok_s": useful[name] / statistics.median(walls),
               "runs_s": walls}
        if "computed" in rs[0]:
            row["padding_waste"] = 1 - rs[0]["useful"] / rs[0]["computed"]
        rows.append(row)
    by = {r["system"]: r["output_tok_s"] for r in rows}
    ours = runs["continuous"][0]["tokens"]
    same = {name: float(np.mean([a == b for a, b in zip(ours, runs[name][0]["tokens"])]))
            for name in ("hf_padded", "hf_sequential")}
    return {"shape": shape if cfg is None else "custom", "dtype": dtype, "device": str(device),
            "requests": num_requests, "prompt_range": list(prompt_range), "output_range": list(output_range),
            "prompt_lengths": [len(p) for p in prompts], "output_lengths": outputs, "seed": seed,
            "max_batch": max_batch, "sequential_requests": k, "repeats": repeats, "rows": rows,
            "logits_check": check, "requests_with_tokens_equal_to_engine": same,
            "graph_replays": graph_replays(llm),
            "continuous_vs_hf_padded": by["continuous"] / by["hf_padded"],
            "continuous_vs_hf_sequential": by["continuous"] / by["hf_sequential"],
            "timing": f"wall clock (perf_counter after a synchronize) of the whole workload, median of {repeats} "
                      f"runs after a two-request warm-up, systems interleaved; output tok/s counts only the "
                      f"tokens requests asked for. hf_sequential runs the first {k} requests only: its tok/s is "
                      f"their tokens / their time (a rate, not extrapolated to a total time)",
            "systems": {"continuous": f"minillm LLM engine, max_num_seqs={max_batch}, chunked prefill, "
                                      f"2048-token step budget, CUDA graphs for decode steps where LLM has them",
                        "hf_padded": f"transformers generate on left-padded batches of {max_batch}, KV cache on, "
                                     f"each batch until its longest request is done",
                        "hf_sequential": "transformers generate, one request at a time, KV cache on"}}


# ---- 3. decode step vs batch: where decode turns compute-bound ----------------------------------------

def decode_batch(runner, batch_size: int, context: int, group_cost) -> object:
    """A PagedBatch of batch_size decode rows, each one token at position `context` over its own blocks
    (blocks b * n .. b * n + n - 1 of the pool; what they hold does not change the speed)."""
    from minillm.model.runner import build_batch

    block_size = runner.kv.block_size
    n = math.ceil((context + 1) / block_size)
    if batch_size * n > runner.kv.num_blocks:          # a kernel would read and write past the pool
        raise ValueError(f"{batch_size} rows x {n} blocks exceed the KV pool's {runner.kv.num_blocks} blocks")
    runs = []
    for b in range(batch_size):
        table = list(range(b * n, (b + 1) * n))
        slot = table[context // block_size] * block_size + context % block_size
        runs.append(([3], context, table, [slot]))
    return build_batch(runs, ["last"] * batch_size, block_size, runner.kv.k.device, group_cost)


def knee(batches: list[int], tok_s: list[float]) -> dict:
    """Where tokens/s stops growing linearly: (a) the first batch whose tokens/s per row falls below
    LINEAR x the smallest batch's; (b) the roofline construction on the measurements: the flat line
    at the smallest batch's step time meets the line through the largest batch's time per row."""
    per_row = [t / b for t, b in zip(tok_s, batches)]
    below = [b for b, p in zip(batches, per_row) if p < LINEAR * per_row[0]]
    step0 = batches[0] / tok_s[0]                                             # seconds per step
    per_row_last = 1 / tok_s[-1]                                              # seconds per row at the largest
    return {"first_batch_below_linear": below[0] if below else None,
            "asymptotes_meet_at_batch": step0 / per_row_last,
            "linear_efficiency": [p / per_row[0] for p in per_row]}


def roofline_batch(cfg, elem: int, context: int, bandwidth: float, flops: float) -> float:
    """Smallest batch whose step's FLOPs at `flops` take as long as its bytes at `bandwidth` (the
    ridge point with measured rates; roofline.compute_bound_batch does it with published ones)."""
    kv_s = context * roofline.kv_bytes_per_token(cfg, elem) / bandwidth           # each row's own KV read
    per_row = roofline.decode_flops_per_token(cfg, context) / flops - kv_s
    return math.inf if per_row <= 0 else roofline.weight_bytes(cfg, elem) / bandwidth / per_row


def decode_vs_batch(device: str = "cuda", shape: str = "llama2-7b", batches=DEFAULT_BATCHES, context: int = 64,
                    samples: int = 10, copy_mbytes: int = 1024, matmul_n: int = 8192, cfg=None,
                    dtype: str = "bfloat16") -> dict:
    """Tokens/s of one decode step of the engine's ModelRunner at each batch size, and the knee."""
    device = check_device(device)
    try:
        batches = sorted(set(batches))
    except TypeError:
        batches = []
    if not batches or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in batches):
        raise ValueError(f"batches = {batches!r} is invalid; allowed: a non-empty list of integers >= 1")
    check_positive(context=context, samples=samples, copy_mbytes=copy_mbytes, matmul_n=matmul_n)
    free(device)
    model = make_model(shape, cfg, device, dtype)
    mcfg, block_size = model.cfg, 16
    if context + 2 > mcfg.max_seq_len:
        raise ValueError(f"context = {context} exceeds the model's {mcfg.max_seq_len} positions")
    per_seq = math.ceil((context + 2) / block_size)
    llm = make_llm(model, device, eager=False, max_model_len=context + 2, max_num_seqs=batches[-1],
                   num_kv_blocks=batches[-1] * per_seq, block_size=block_size)
    runner, group_cost = llm.engine.runner, llm.engine.decode_group_cost
    rows = []
    with torch.no_grad():
        for b in batches:
            batch = decode_batch(runner, b, context, group_cost)
            timing = time_kernel(lambda: runner.forward(batch), device=device, samples=samples, warmup=3)
            method = timing["method"]
            rows.append({"batch": b, "step_ms": 1e3 * timing["median_s"], "p10_ms": 1e3 * timing["p10_s"],
                         "p90_ms": 1e3 * timing["p90_s"], "tok_s": b / timing["median_s"]})
    replays = graph_replays(llm)
    del llm, runner, batch
    free(device)
    bandwidth = copy_bandwidth(device, copy_mbytes)["bytes_per_s"]
    mm = matmul_flops(device, dtype, matmul_n)
    elem = element_size(dtype)
    for row in rows:
        t_mem = roofline.decode_bytes_per_step(mcfg, elem, context, row["batch"]) / bandwidth
        t_flop = row["batch"] * roofline.decode_flops_per_token(mcfg, context) / mm["flops_per_s"]
        row.update({"roofline_tok_s": row["batch"] / max(t_mem, t_flop),
                    "fraction_of_roofline": row["tok_s"] * max(t_mem, t_flop) / row["batch"]})
    measured = knee([r["batch"] for r in rows], [r["tok_s"] for r in rows])
    for row, eff in zip(rows, measured.pop("linear_efficiency")):
        row["linear_efficiency"] = eff
    return {"shape": shape if cfg is None else "custom", "dtype": dtype, "device": str(device),
            "context": context, "batches": batches, "rows": rows, "graph_replays": replays,
            "what": "one decode step of the engine's ModelRunner.forward (embed, layers over the paged KV "
                    "cache, LM head), a CUDA graph replay where the engine would replay one; no scheduling, "
                    "sampling or detokenising",
            "timing": f"kernel_timing.time_kernel: {method}",
            "copy_bandwidth_GBps": bandwidth / 1e9, "matmul_TFLOPs": mm["flops_per_s"] / 1e12, "matmul_n": matmul_n,
            "roofline_compute_bound_batch": roofline_batch(mcfg, elem, context, bandwidth, mm["flops_per_s"]),
            "roofline_compute_bound_batch_published_H200": roofline.compute_bound_batch(mcfg, "H200", elem, context),
            **{f"measured_{k}": v for k, v in measured.items()},
            "linear_threshold": LINEAR}


# ---- the document ------------------------------------------------------------------------------------

def settings(quick: bool) -> dict:
    """GPU sizes. Full: ~15 s + ~40 s + ~10 s of measuring on an H200 (7B bf16 decode ~4 ms/token)."""
    if quick:                  # the 1B shape everywhere: the same code paths in a few seconds each
        return {"decode_bound": dict(shape="llama3.2-1b", new_tokens=32, repeats=2, copy_mbytes=256),
                "batching_vs_hf": dict(num_requests=8, prompt_range=(16, 64), output_range=(8, 32), max_batch=4,
                                       sequential_requests=2, repeats=2),
                "decode_vs_batch": dict(shape="llama3.2-1b", batches=(1, 8, 64), samples=5, copy_mbytes=256,
                                        matmul_n=4096)}
    return {"decode_bound": dict(new_tokens=128, prompt_tokens=16, repeats=3),
            "batching_vs_hf": dict(num_requests=32, prompt_range=(16, 256), output_range=(16, 128), max_batch=16,
                                   sequential_requests=4, repeats=3),
            "decode_vs_batch": dict(batches=DEFAULT_BATCHES, context=64, samples=10)}


PARTS = ("decode_bound", "batching_vs_hf", "decode_vs_batch")


def run(device: str = "cuda", quick: bool = False) -> dict:
    """The three parts in turn, the memory freed between them. A part that fails is recorded (its
    traceback under config.errors) and the others still run: one GPU session yields what it can."""
    import traceback

    device = check_device(device)
    sizes = settings(quick)
    started = time.perf_counter()
    parts, seconds, errors = {}, {}, {}
    for name in PARTS:
        t0 = time.perf_counter()
        try:
            parts[name] = globals()[name](device, **sizes[name])
        except Exception:                              # noqa: BLE001 - recorded, and the next part runs
            errors[name] = traceback.format_exc()
        free(device)
        seconds[name] = time.perf_counter() - t0
        print(f"{name}: {seconds[name]:.1f} s{' FAILED' if name in errors else ''}", flush=True)
    results = [dict(part=name, **row) for name, part in parts.items() for row in part["rows"]]
    config = {"device": str(device), "quick": quick, "sizes": sizes, "seconds": seconds, "errors": errors,
              "total_seconds": time.perf_counter() - started, "enforce_eager_available": has_enforce_eager(),
              "parts": {name: {k: v for k, v in part.items() if k != "rows"} for name, part in parts.items()}}
    return document(NAME, config, results, summarise(parts))


def summarise(parts: dict) -> dict:
    """The headline numbers of whichever parts ran, and each goal of the issue: met or not."""
    summary, met = {"goals": GOALS}, {}
    if "decode_bound" in parts:
        d = parts["decode_bound"]
        summary.update({"decode_best_fraction_of_hbm_bound": d["best_fraction_of_hbm_bound"],
                        "decode_best_system": d["best_system"], "hbm_bound_tok_s": d["hbm_bound_tok_s"],
                        "decode_tok_s": {r["system"]: r["decode_tok_s"] for r in d["rows"]}})
        met["fraction_of_hbm_bound"] = d["best_fraction_of_hbm_bound"] >= GOALS["fraction_of_hbm_bound"]
    if "batching_vs_hf" in parts:
        b = parts["batching_vs_hf"]
        for key in ("continuous_vs_hf_padded", "continuous_vs_hf_sequential"):
            summary[key] = b[key]
            met[key] = b[key] >= GOALS[key]
        summary["hf_logits_max_abs_diff"] = b["logits_check"]["max_abs_diff"]
    if "decode_vs_batch" in parts:
        s = parts["decode_vs_batch"]
        summary.update({"decode_knee_first_batch_below_linear": s["measured_first_batch_below_linear"],
                        "decode_knee_asymptotes": s["measured_asymptotes_meet_at_batch"],
                        "decode_knee_roofline": s["roofline_compute_bound_batch"]})
    summary["goals_met"] = met
    return summary
