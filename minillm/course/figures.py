"""Concept figures for the lessons, drawn from this package's own functions and runs.

    python -m minillm figures [--quick] [--out lessons/figures]

A figure that shows a mechanism is drawn from a trace of the code that implements it, never
from a hand-made picture: the block table from a BlockManager run, the Gantt chart from the
engine's scheduler and from static batching, the speculative timeline from speculative_stream,
the FlashAttention state from flash_attention_torch. Each trace is a plain function with a
plain return value (tests/course/test_figures.py checks the traces against the code's own records);
each draw_* function only draws it. Everything is seeded, and the figures take well under a
minute on a 2-core CPU, most of it loading SmolLM2 for the speculative run (--quick: a tiny
random model instead).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from minillm.course.calculators import kv_cache_bytes
from minillm.engine.request import Request
from minillm.engine.sampling import SamplingParams
from minillm.kvcache.block_manager import BlockManager
from minillm.model.llama import random_model, tiny_config
from minillm.perf import roofline

ROOT = Path(__file__).resolve().parents[2]
OUT_DIR = ROOT / "lessons" / "figures"
WIDTH, DPI = 10.0, 110          # inches at lesson width; ~1100 pixels
MODELS = {"SmolLM2-135M": roofline.SMOLLM2_135M, "Llama-2-7B": roofline.LLAMA2_7B, "Llama-2-70B": roofline.LLAMA2_70B}
COLORS = {"SmolLM2-135M": "tab:green", "Llama-2-7B": "tab:blue", "Llama-2-70B": "tab:purple",
          "A100 80GB": "tab:orange", "H100 SXM": "tab:red", "H200": "tab:brown",
          "prefill": "#4c72b0", "decode": "#8fb8de", "idle": "#e07b6a", "waiting": "#eeeeee",
          "accepted": "#8fd18f", "rejected": "#e58a8a", "unchecked": "#dddddd", "correction": "#8fb8de",
          "bonus": "#f2c85b", "plain": "#c9c3e6", "shared": "#f2c85b", "own": "#8fb8de", "free": "#f4f4f4",
          "tile": "#f2c85b", "state": "#fde3a7"}


def new_figure(height: float):
    """A Figure at lesson width without pyplot: no global state, and Agg draws it when saved."""
    from matplotlib.figure import Figure

    return Figure(figsize=(WIDTH, height), dpi=DPI, layout="constrained")


def save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    return path


def box(ax, x, y, w, h, text="", color="white", fontsize=8, **kwargs):
    """A labelled rectangle with its lower-left corner at (x, y)."""
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor=kwargs.pop("edgecolor", "black"),
                           linewidth=kwargs.pop("linewidth", 0.8), **kwargs))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def arrow(ax, start, end, **kwargs):
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle="->", lw=0.9, **kwargs))


# ------------------------------------------------------------------------------------ 01 roofline

def cpu_roofs(path: Path = ROOT / "results" / "roofline.json") -> dict[str, dict]:
    """This machine's measured peaks (lesson 01's benchmark), in the GPUS dict's units."""
    doc = json.loads(path.read_text())
    return {f"{doc['machine']['cpu']} CPU, {r['dtype']}": {"flops": r["gemm_GFLOPs"] * 1e9,
                                                            "bandwidth": r["bandwidth_GBps"] * 1e9}
            for r in doc["results"]}


def draw_roofline(path: Path) -> Path:
    """Left: attainable FLOP/s = min(peak, bandwidth x intensity) for this CPU (measured) and three
    GPUs (datasheets), ridge points marked, decode and prefill intensities as verticals. Right: the
    decode batch at which each model turns compute-bound on an H100, against context length."""
    fig = new_figure(4.4)
    ax, bx = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.25, 1]})
    intensity = torch.logspace(-1, 3.5, 200).tolist()
    roofs = {**cpu_roofs(), **roofline.GPUS}
    for i, (name, m) in enumerate(roofs.items()):
        color = COLORS.get(name, "0.3" if i == 0 else "0.6")     # the CPU's rows: fp32 dark, bf16 light
        ax.plot(intensity, [min(m["flops"], m["bandwidth"] * x) for x in intensity], color=color, label=name)
        ridge = m["flops"] / m["bandwidth"]
        ax.plot([ridge], [m["flops"]], "o", color=color)
        left = name == "H200"                                      # H100 and H200 peak at one height: label apart
        ax.annotate(f"ridge {ridge:.0f}" if ridge > 20 else f"ridge {ridge:.1f}", (ridge, m["flops"]),
                    textcoords="offset points", xytext=(-6, 4) if left else (4, 4), fontsize=7, color=color,
                    ha="right" if left else "left")
    smol = MODELS["SmolLM2-135M"]
    for label, x, side in (("decode, batch 1 (bf16)", roofline.arithmetic_intensity(smol, 2, 1), "left"),
                           ("prefill, 512 tokens", roofline.arithmetic_intensity(smol, 2, 512), "right")):
        ax.axvline(x, color="0.4", linestyle=":", linewidth=1)
        ax.text(x * (1.1 if side == "left" else 0.9), 1.3e9, label, fontsize=7, color="0.3", ha=side)
    ax.set(xscale="log", yscale="log", ylim=(1e9, 3e15), xlabel="arithmetic intensity (FLOP per byte read)",
           ylabel="attainable FLOP/s", title="Roofline: below the ridge, bandwidth decides")
    ax.legend(fontsize=7, loc="upper left")
    draw_compute_bound_batch(bx)
    return save(fig, path)


def draw_bandwidth_over_time(path: Path, roofline_json: Path = ROOT / "results" / "roofline.json") -> Path:
    """The read bandwidth samples of lesson 01's run (summary.bandwidth_over_time) in the order taken,
    with every thread, then with one, beside the bound's denominator (the fastest sample of the fp32 rows)."""
    doc = json.loads(roofline_json.read_text())
    series = doc["summary"]["bandwidth_over_time"]
    fig = new_figure(2.6)
    ax = fig.subplots()
    start = 0
    for key in sorted((k for k in series if k.startswith("threads_")), key=lambda k: k == "threads_1"):
        samples = series[key]                                              # taken in this order, one series after the other
        ax.plot(range(start, start + len(samples)), samples, "o-", markersize=3,
                color="0.6" if key == "threads_1" else "0.2", label=key.replace("threads_", "threads: "))
        start += len(samples)
    best = doc["results"][0]["bandwidth_GBps"]
    ax.axhline(best, color="tab:red", linestyle=":", linewidth=1)
    ax.text(0, best, f" fastest fp32 sample of the run: {best:.1f} GB/s (the bound's denominator)", fontsize=7,
            color="tab:red", va="bottom")
    ax.set(xlabel=f"sample, in the order taken ({series['seconds_apart']} s apart plus the time a sample takes)",
           ylabel="read GB/s (512 MB, fp32)",
           ylim=(0, best * 1.2), title=f"{doc['machine']['cpu']} VM: one function, one machine, one run")
    ax.legend(fontsize=7, loc="lower right")
    return save(fig, path)


def draw_compute_bound_batch(ax, gpu: str = "H100 SXM") -> None:
    """roofline.compute_bound_batch against context, bf16 weights and KV; inf (never) is not drawn."""
    contexts = sorted({int(c) for c in torch.logspace(0, 13, 300, base=2).tolist()})
    for name, cfg in MODELS.items():
        batches = [roofline.compute_bound_batch(cfg, gpu, 2, c) for c in contexts]
        finite = [(c, b) for c, b in zip(contexts, batches) if b < math.inf]
        ax.plot(*zip(*finite), color=COLORS[name], label=name)
        if len(finite) < len(contexts):                            # from here on: never compute-bound
            ax.axvline(contexts[len(finite)], color=COLORS[name], linestyle=":", linewidth=1)
    ax.axhline(roofline.ridge_point(gpu), color="0.5", linestyle="--", linewidth=0.8)
    ax.text(1.2, roofline.ridge_point(gpu) * 0.85, "context 0: batch = the ridge point", fontsize=7, va="top")
    ax.set(xscale="log", yscale="log", xlim=(1, contexts[-1]), ylim=(50, 2e4), xlabel="context per sequence (tokens)",
           ylabel="batch where decode turns compute-bound",
           title=f"{gpu}, bf16 weights and KV cache:\npast a dotted line no batch is compute-bound")
    ax.legend(fontsize=7, loc="upper left")


# ------------------------------------------------------------------------------------ 02 KV growth

def draw_kv_growth(path: Path) -> Path:
    """Left: KV bytes against context for three models at batch 1 and 32 (kv_cache_bytes), each
    model's bf16 weights dotted. Right: FLOPs to produce one token at position t with a cache
    (decode_flops_per_token) and without (prefill_flops: the whole sequence again)."""
    fig = new_figure(4.2)
    ax, bx = fig.subplots(1, 2)
    contexts = [2 ** i for i in range(7, 18)]
    for name, cfg in MODELS.items():
        for batch, style in ((1, "-"), (32, "--")):
            gb = [kv_cache_bytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, t, batch, 2) / 1e9 for t in contexts]
            ax.plot(contexts, gb, style, color=COLORS[name], label=f"{name}, batch {batch}")
        ax.axhline(roofline.weight_bytes(cfg, 2) / 1e9, color=COLORS[name], linestyle=":", linewidth=1)
    ax.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel="KV cache, bf16 (GB)",
           title="KV memory grows with length x batch\n(dotted: the model's bf16 weights)")
    ax.legend(fontsize=6.5, ncol=1, loc="upper left")
    positions = [2 ** i for i in range(0, 14)]
    for name in ("SmolLM2-135M", "Llama-2-7B"):
        cfg = MODELS[name]
        bx.plot(positions, [roofline.decode_flops_per_token(cfg, t) for t in positions], color=COLORS[name],
                label=f"{name}, KV cache")
        bx.plot(positions, [roofline.prefill_flops(cfg, t) for t in positions], "--", color=COLORS[name],
                label=f"{name}, no cache (recompute)")
    bx.set(xscale="log", yscale="log", xlabel="position of the generated token", ylabel="FLOPs for that one token",
           title="Without a cache, token t costs a forward over t tokens")
    bx.legend(fontsize=6.5, loc="upper left")
    return save(fig, path)


# ------------------------------------------------------------------------------------ 05 FlashAttention

@dataclass
class OnlineSoftmaxTrace:
    """One query row streamed past key tiles: its scores and the running (m, l) after each tile."""
    scores: list[float]            # scale * q.k for every key
    block_n: int
    m: list[float]                 # running max after tile j
    l: list[float]                 # running sum of exp(s - m) after tile j


def online_softmax_trace(num_tiles: int = 4, block_n: int = 8, head_dim: int = 16, seed: int = 0) -> OnlineSoftmaxTrace:
    """m after tile j is the max score so far; l comes from the library itself:
    flash_attention_torch over the first j tiles returns LSE = m + log(l), so l = exp(LSE - m).
    Keys get a growing offset along q so that the max moves up tile by tile (and l is rescaled)."""
    from minillm.attention.flash import flash_attention_torch

    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, 1, head_dim, generator=gen)
    k = torch.randn(1, 1, num_tiles * block_n, head_dim, generator=gen)
    k += 0.6 * torch.arange(num_tiles * block_n).div(block_n, rounding_mode="floor")[:, None] * q / q.norm()
    v = torch.randn(k.shape, generator=gen)
    scores = (q[0, 0] @ k[0, 0].T / math.sqrt(head_dim))[0]                       # (Tk,)
    m, l = [], []
    for j in range(1, num_tiles + 1):
        n = j * block_n
        _, lse = flash_attention_torch(q, k[:, :, :n], v[:, :, :n], causal=False, block_m=1, block_n=block_n)
        m.append(float(scores[:n].max()))
        l.append(math.exp(float(lse[0, 0, 0]) - m[-1]))
    return OnlineSoftmaxTrace(scores.tolist(), block_n, m, l)


def draw_flash_tiles(path: Path) -> Path:
    fig = new_figure(6.2)
    top, bottom = fig.subplots(2, 1, height_ratios=[1.35, 1])
    draw_tiling_diagram(top)
    draw_online_softmax(bottom, online_softmax_trace())
    return save(fig, path)


def draw_tiling_diagram(ax, tiles: int = 4) -> None:
    """HBM holds Q, K, V, O whole; the SRAM of one program holds one Q tile, one K/V tile, one
    score tile and the rows' state (m, l, acc). Drawn while program 0 reads K/V tile 2; each
    arrow sits at the height of the HBM tiles it moves."""
    ax.set(xlim=(0, 20), ylim=(0, 10))
    ax.axis("off")
    box(ax, 0.2, 0.2, 9.6, 9.6, color="#f7f7f7", linewidth=1.2)
    ax.text(0.5, 9.1, "HBM (large, slow): whole matrices, N rows each", fontsize=9, weight="bold")
    box(ax, 10.6, 0.2, 9.2, 9.6, color="#fff8e6", linewidth=1.2)
    ax.text(10.9, 9.1, "SRAM of one program (small, fast)", fontsize=9, weight="bold")
    th, hot = 1.8, {"Q0", "K2", "V2", "O0"}
    tile_y = lambda i: 0.6 + (tiles - 1 - i) * th                  # noqa: E731  (tile 0 on top)
    for col, name in enumerate("QKVO"):
        x = 0.8 + col * 2.3
        ax.text(x + 0.8, 8.2, name, ha="center", fontsize=9)
        for i in range(tiles):
            box(ax, x, tile_y(i), 1.6, th, f"{name}{i}", COLORS["tile"] if f"{name}{i}" in hot else "white")
    top, mid = tile_y(0), tile_y(2)
    sram = {"Q0": (11.2, top + 0.95, 1.8, 0.85), "acc (bm x D)": (11.2, top, 1.8, 0.85),
            "m, l\n(bm each)": (13.3, top, 1.8, 1.8),
            "K2": (11.2, mid + 0.2, 1.6, 1.4), "V2": (13.0, mid + 0.2, 1.6, 1.4),
            "S = Q0 K2ᵀ (bm x bn)": (14.8, mid + 0.2, 4.6, 1.4)}
    for text, (x, y, w, h) in sram.items():
        box(ax, x, y, w, h, text, COLORS["tile"] if len(text) == 2 else COLORS["state"])
    arrow(ax, (9.8, top + 1.375), (11.2, top + 1.375), color="tab:blue")
    arrow(ax, (11.2, top + 0.425), (9.8, top + 0.425), color="tab:green")
    arrow(ax, (9.8, mid + 0.9), (11.2, mid + 0.9), color="tab:red")
    ax.text(15.4, top + 0.9, "stay for the\nwhole loop", fontsize=8, va="center")
    ax.text(11.2, tile_y(1) + 0.7, "S, m, l, acc never leave SRAM:\nno N x N matrix is written to HBM", fontsize=8)
    notes = (("tab:blue", "Q0: loaded once by its program"),
             ("tab:red", "K_j, V_j: streamed through, j = 0, 1, 2, 3"),
             ("tab:green", "O0 = acc / l: written once, after the last tile"))
    for i, (color, text) in enumerate(notes):
        ax.text(11.0, 1.7 - i * 0.6, text, fontsize=8, color=color)


def draw_online_softmax(ax, trace: OnlineSoftmaxTrace) -> None:
    keys = list(range(len(trace.scores)))
    ax.plot(keys, trace.scores, ".", color="0.4", label="score s of each key")
    bn = trace.block_n
    for j, (m, l) in enumerate(zip(trace.m, trace.l)):
        ax.hlines(m, j * bn - 0.4, (j + 1) * bn - 0.6, color="tab:red", linewidth=2,
                  label="running max m after the tile" if j == 0 else None)
        ax.text(j * bn + bn / 2 - 0.5, m + 0.15, f"m = {m:.2f}\nl = {l:.2f}", ha="center", fontsize=8)
        if j:
            ax.axvline(j * bn - 0.5, color="0.7", linewidth=0.8)
            if m > trace.m[j - 1]:
                ax.text(j * bn + 0.1, min(trace.scores) - 0.1, f"m rose: l x exp({trace.m[j - 1]:.2f} - {m:.2f})",
                        fontsize=7, color="tab:red", va="bottom")
    ax.set(xlabel=f"key index (tiles of {bn} keys)", ylabel="score", xlim=(-1, len(keys)),
           ylim=(min(trace.scores) - 0.3, max(trace.m) + 1.0),
           title="One query row, tile by tile: m and l from flash_attention_torch (l = exp(LSE - m))")
    ax.legend(fontsize=7, loc="upper left")


# ------------------------------------------------------------------------------------ 06 block table

@dataclass
class BlockSnapshot:
    """The block manager's state after one event (the picture is this, nothing else)."""
    event: str
    tables: dict[str, list[int]]             # request_id -> physical block of each logical block
    words: dict[str, list[str]]              # request_id -> its tokens, as words
    ref_counts: list[int]
    copies: list[tuple[int, int]] = field(default_factory=list)   # copy-on-write (src, dst) of this event


BLOCK_SIZE = 4
PROMPT_A = "the cat sat on the mat and then ran".split()
PROMPT_B = "the cat sat on the mat and then slept".split()


def block_table_trace(num_blocks: int = 6) -> list[BlockSnapshot]:
    """A real BlockManager run (block size 4, prefix caching on): A is prefilled; B shares A's two
    full blocks through the prefix cache; C forks A (a second sample of the same prompt) and shares
    all three; C writes its next token into the shared last block (copy-on-write); A writes its own
    next token in place, since its last block is no longer shared."""
    word_of = list(dict.fromkeys(PROMPT_A + PROMPT_B + ["off", "away"]))      # token id -> word
    ids = lambda words: [word_of.index(w) for w in words]          # noqa: E731
    bm = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True)
    reqs: dict[str, Request] = {}
    snaps = []

    def snap(event, copies=()):
        snaps.append(BlockSnapshot(event, {r: bm.block_table(r) for r in bm.request_ids},
                                   {r: [word_of[t] for t in reqs[r].all_token_ids] for r in bm.request_ids},
                                   list(bm.pool.ref_counts), list(copies)))

    for name, prompt in (("A", PROMPT_A), ("B", PROMPT_B)):
        req = reqs[name] = Request.from_token_ids(name, ids(prompt))
        bm.allocate(req)
        req.num_computed_tokens = req.num_tokens                   # prefilled
        bm.cache_blocks(req)
        snap(f"{name} prefilled" if name == "A" else "B hits A's cached prefix")
    reqs["C"] = Request.from_token_ids("C", ids(PROMPT_A))
    reqs["C"].num_computed_tokens = reqs["A"].num_computed_tokens   # a copy of A
    bm.fork("A", "C")
    snap("C forks A")
    for name, word in (("C", "off"), ("A", "away")):
        reqs[name].output_token_ids += ids([word])
        copies = bm.append_slots(reqs[name], reqs[name].num_tokens)
        snap(f"{name} writes '{word}'", copies)
    return snaps


def physical_contents(snap: BlockSnapshot) -> dict[int, list[str]]:
    """Words held by each physical block, read through the block tables."""
    held = {}
    for seq, table in snap.tables.items():
        for i, block in enumerate(table):
            held.setdefault(block, snap.words[seq][i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
    return held


def draw_block_table(path: Path, snaps: list[BlockSnapshot] | None = None) -> Path:
    snaps = snaps or block_table_trace()
    shown = [next(s for s in snaps if s.event == "C forks A"), snaps[-1]]
    copies = [c for s in snaps for c in s.copies]
    fig = new_figure(4.4)
    axes = fig.subplots(1, 2)
    titles = ("B shares A's prefix (prefix cache), C forks A", "C writes: copy-on-write; A writes in place")
    for ax, snap, title in zip(axes, shown, titles):
        draw_block_snapshot(ax, snap, copies if snap is snaps[-1] else [])
        ax.set_title(title, fontsize=9)
    return save(fig, path)


def draw_block_snapshot(ax, snap: BlockSnapshot, copies: list[tuple[int, int]]) -> None:
    """Left: every sequence's logical blocks, one row each; right: the physical pool with its ref
    counts and the words each block holds; a line per block-table entry; copy-on-write arcs."""
    ax.set(xlim=(0, 10.6), ylim=(-0.2, 11))
    ax.axis("off")
    held = physical_contents(snap)
    rows = [(seq, i, block) for seq, table in snap.tables.items() for i, block in enumerate(table)]
    gap = 9.6 / len(snap.ref_counts)
    phys_y = lambda block: 9.6 - (block + 1) * gap + 0.1           # noqa: E731
    ax.text(0.3, 10.4, "block tables", fontsize=8)
    ax.text(4.6, 10.4, "physical blocks (words held), ref counts; yellow: shared", fontsize=8)
    y, seq_before = 9.6, None
    for seq, i, block in rows:
        y -= 0.95 + (0.35 if seq_before not in (None, seq) else 0)
        seq_before = seq
        box(ax, 0.3, y, 1.9, 0.75, f"{seq}: logical {i}", "white", fontsize=7)
        ax.plot([2.2, 4.6], [y + 0.375, phys_y(block) + gap * 0.35], color="0.55", linewidth=0.8)
    for block, ref in enumerate(snap.ref_counts):
        color = COLORS["shared"] if ref > 1 else COLORS["own"] if ref else COLORS["free"]
        words = " ".join(held.get(block, [])) if ref else "free"
        box(ax, 4.6, phys_y(block), 3.6, gap * 0.7, f"P{block}: {words}", color, fontsize=7)
        ax.text(8.3, phys_y(block) + gap * 0.35, f"ref {ref}", va="center", fontsize=7)
    for src, dst in copies:
        ax.annotate("", xy=(9.0, phys_y(dst) + gap * 0.35), xytext=(9.0, phys_y(src) + gap * 0.35),
                    arrowprops=dict(arrowstyle="->", color="tab:red", connectionstyle="arc3,rad=-0.5"))
        ax.text(9.75, (phys_y(src) + phys_y(dst)) / 2 + gap * 0.35, f"copy\nP{src}\n-> P{dst}", fontsize=7,
                color="tab:red", va="center")


# ------------------------------------------------------------------------------------ 07 batching Gantt

@dataclass
class GanttTrace:
    """Per step, what each request did: 'prefill', 'decode' or 'idle' (a static-batch row that is
    done but still computed). Requests absent from a step are waiting (or finished)."""
    name: str
    steps: list[dict[str, str]]
    requests: list[str]


class NumberTokenizer:
    """Just enough tokenizer for a random-weight model: token ids printed as numbers."""
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(map(str, ids))


GANTT_PROMPT_LENS = [12, 5, 20, 8, 15, 6, 10, 4]
GANTT_MAX_TOKENS = [12, 3, 6, 2, 9, 4, 7, 3]
GANTT_BATCH = 4


def gantt_workload(vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in GANTT_PROMPT_LENS]
    return prompts, list(GANTT_MAX_TOKENS)


def static_trace(model, prompts, max_tokens, batch_size: int = GANTT_BATCH) -> tuple[GanttTrace, dict]:
    """Runs static_batching.generate_static and lays its batches out step by step: each batch runs
    until its longest request is done (one forward per step: the prefill gives the first token);
    a row whose request is done computes padding (idle). Returns the trace and generate_static's output."""
    from minillm.stages.static_batching import generate_static

    out = generate_static(model, prompts, max_tokens, batch_size)
    steps = []
    for first in range(0, len(prompts), batch_size):
        batch = range(first, min(first + batch_size, len(prompts)))
        produced = {i: len(out["token_ids"][i]) for i in batch}
        for t in range(max(produced.values())):
            steps.append({str(i): "prefill" if t == 0 else "decode" if t < produced[i] else "idle" for i in batch})
    return GanttTrace("static batching", steps, [str(i) for i in range(len(prompts))]), out


def record_plans(scheduler) -> list[list[tuple[str, int, int]]]:
    """Wrap scheduler.schedule on this instance: each step's plan is appended as
    (request_id, num_computed_tokens before the step, num_new_tokens) per scheduled request."""
    plans = []
    schedule = scheduler.schedule

    def recording():
        plan = schedule()
        if plan.requests:
            plans.append([(r.request_id, r.num_computed_tokens, n) for r, n in zip(plan.requests, plan.num_new_tokens)])
        return plan

    scheduler.schedule = recording
    return plans


def continuous_trace(model, prompts, max_tokens, max_num_seqs: int = GANTT_BATCH):
    """Runs the engine (continuous batching, max_num_seqs rows) on the same requests and records
    each step's plan. Returns the trace (request ids renumbered 0..n-1 in submission order), the
    recorded plans and the engine's own step log for those steps."""
    from minillm.llm import LLM

    llm = LLM(model=model, tokenizer=NumberTokenizer(), device="cpu", max_model_len=64, max_num_seqs=max_num_seqs)
    reqs = llm.make_requests([{"prompt_token_ids": p} for p in prompts],
                             [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens])
    name = {r.request_id: str(i) for i, r in enumerate(reqs)}
    prompt_len = {r.request_id: len(r.prompt_token_ids) for r in reqs}
    engine = llm.engine
    plans = record_plans(engine.scheduler)
    first = len(engine.step_log)
    engine.run(reqs)
    steps = [{name[rid]: "prefill" if start < prompt_len[rid] else "decode" for rid, start, _ in plan}
             for plan in plans]
    trace = GanttTrace("continuous batching", steps, [str(i) for i in range(len(reqs))])
    return trace, plans, engine.step_log[first:]


def batching_traces(seed: int = 0) -> tuple[GanttTrace, GanttTrace]:
    model = random_model(tiny_config(), seed=seed)
    prompts, max_tokens = gantt_workload(model.cfg.vocab_size, seed)
    return static_trace(model, prompts, max_tokens)[0], continuous_trace(model, prompts, max_tokens)[0]


def draw_batching_gantt(path: Path, traces: tuple[GanttTrace, GanttTrace] | None = None) -> Path:
    traces = traces or batching_traces()
    horizon = max(len(t.steps) for t in traces)
    fig = new_figure(5.4)
    axes = fig.subplots(2, 1, sharex=True)
    for ax, trace in zip(axes, traces):
        draw_gantt(ax, trace, horizon)
    axes[-1].set_xlabel("engine step (one forward pass each)")
    axes[-1].xaxis.get_major_locator().set_params(integer=True)
    fig.legend(handles=gantt_legend(), fontsize=8, loc="outside upper center", ncol=4)
    return save(fig, path)


def gantt_legend() -> list:
    from matplotlib.patches import Patch

    return [Patch(color=COLORS["prefill"], label="prefill (and its first token)"),
            Patch(color=COLORS["decode"], label="decode"),
            Patch(facecolor=COLORS["idle"], hatch="//", label="idle: done, still computed"),
            Patch(color=COLORS["waiting"], label="waiting")]


def draw_gantt(ax, trace: GanttTrace, horizon: int) -> None:
    for r, req in enumerate(trace.requests):
        done = max((s for s, step in enumerate(trace.steps) if req in step), default=-1)
        ax.barh(r, done + 1, left=0, height=0.8, color=COLORS["waiting"])       # submitted at step 0
        for s, step in enumerate(trace.steps):
            if req in step:
                ax.barh(r, 1, left=s, height=0.8, color=COLORS[step[req]], edgecolor="white", linewidth=0.5,
                        hatch="//" if step[req] == "idle" else None)
    rows = sum(len(step) for step in trace.steps)
    idle = sum(kind == "idle" for step in trace.steps for kind in step.values())
    ax.set(yticks=range(len(trace.requests)), yticklabels=[f"req {r}" for r in trace.requests],
           xlim=(0, horizon), ylim=(len(trace.requests) - 0.4, -0.6))
    ax.set_title(f"{trace.name}: {len(trace.steps)} steps, {idle} of {rows} computed rows idle", fontsize=9)


# ------------------------------------------------------------------------------------ 08 speculative

@dataclass
class SpecRound:
    """One verification step: what the draft proposed, how many the target accepted, and the one
    token the target added (a correction when a draft was rejected, a bonus when all passed)."""
    drafted: list[int]
    accepted: int
    target_token: int | None       # None when a stop inside the run ended the request first

    @property
    def target_kind(self) -> str:
        """'plain' (nothing drafted), 'bonus' (all drafts accepted) or 'correction'."""
        return "plain" if not self.drafted else "bonus" if self.accepted == len(self.drafted) else "correction"


def speculative_trace(llm, prompt: str, method: str = "ngram", k: int = 4,
                      max_tokens: int = 24) -> tuple[list[SpecRound], list[int]]:
    """A greedy speculative_stream run, with the draft's proposals recorded (its propose method is
    wrapped on this one draft instance). Returns the rounds and the request's output token ids."""
    from minillm.speculative.core import SpecStats, make_draft
    from minillm.stages.speculative_loop import speculative_stream

    draft = make_draft(llm.model, method)
    proposals = []
    propose = draft.propose

    def recording(context, n, params, generator):
        tokens, q = propose(context, n, params, generator)
        proposals.append(list(tokens))
        return tokens, q

    draft.propose = recording
    stats = SpecStats()
    (req,) = llm.make_requests([prompt], SamplingParams(temperature=0, max_tokens=max_tokens))
    for _ in speculative_stream(llm, req, method, k, stats, draft=draft):
        pass
    rounds, pos = [], 1                              # output token 0 comes from the prefill
    for drafted, accepted in zip(proposals, stats.accepted_per_call):
        emitted = req.output_token_ids[pos:pos + accepted + 1]
        rounds.append(SpecRound(drafted, accepted, emitted[accepted] if len(emitted) > accepted else None))
        pos += accepted + 1
    return rounds, list(req.output_token_ids)


def speculative_example(quick: bool):
    """(llm, prompt, model name): SmolLM2 on lesson 08's input-grounded prompt (a copy-edit, what
    prompt lookup feeds on), or in quick mode a tiny random model on a prompt that repeats itself."""
    from minillm.llm import LLM

    if quick:
        llm = LLM(model=random_model(tiny_config(), seed=0), tokenizer=NumberTokenizer(), device="cpu",
                  max_model_len=128)
        return llm, {"prompt_token_ids": [5, 6, 7, 8, 9] * 6}, "tiny random model"
    from minillm.course.benchmarks.speculative import PROMPTS

    llm = LLM(model="smollm2", dtype="float32", device="cpu")
    prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": PROMPTS["grounded"]}])
    return llm, prompt, "SmolLM2-135M"


def token_label(tokenizer, token: int) -> str:
    text = tokenizer.decode([token]).replace("\n", "\\n")
    return text if text.strip() else repr(text)


def draw_speculative_timeline(path: Path, quick: bool = False, k: int = 4, max_tokens: int = 32) -> Path:
    llm, prompt, model_name = speculative_example(quick)
    rounds, output = speculative_trace(llm, prompt, "ngram", k, max_tokens)
    label = lambda token: token_label(llm.get_tokenizer(), token)  # noqa: E731
    fig = new_figure(1.3 + 0.42 * len(rounds))
    ax = fig.subplots()
    w, h = 1.55, 0.8
    ax.text(-0.15, h / 2, "prefill", ha="right", va="center", fontsize=8)
    box(ax, (k + 0.4) * w, 0, w - 0.08, h, label(output[0]), COLORS["plain"])
    for r, rnd in enumerate(rounds, start=1):
        verdict = f"{rnd.accepted} of {len(rnd.drafted)} accepted" if rnd.drafted else "no draft"
        ax.text(-0.15, r + h / 2, f"step {r}: {verdict}", ha="right", va="center", fontsize=8)
        if not rnd.drafted:
            ax.text(w * k / 2, r + h / 2, "no n-gram match: a plain decode step", ha="center", va="center",
                    fontsize=8, color="0.4")
        for i, token in enumerate(rnd.drafted):
            kind = "accepted" if i < rnd.accepted else "rejected" if i == rnd.accepted else "unchecked"
            box(ax, i * w, r, w - 0.08, h, label(token), COLORS[kind])
        if rnd.target_token is not None:
            box(ax, (k + 0.4) * w, r, w - 0.08, h, label(rnd.target_token), COLORS[rnd.target_kind])
    ax.set(xlim=(-2.6, (k + 1.4) * w), ylim=(len(rounds) + 1.1, -0.9))
    ax.axis("off")
    for i in range(k):
        ax.text(i * w + w / 2, -0.4, f"draft {i + 1}", ha="center", fontsize=8)
    ax.text((k + 0.4) * w + w / 2, -0.4, "target adds", ha="center", fontsize=8)
    ax.set_title(f"{model_name}, greedy, prompt-lookup draft, k = {k}: one row per target forward", fontsize=9)
    from matplotlib.patches import Patch

    kinds = ("accepted", "rejected", "unchecked", "correction", "bonus", "plain")
    ax.legend(handles=[Patch(color=COLORS[c], label=c if c != "plain" else "plain step") for c in kinds],
              fontsize=7, loc="lower center", ncol=len(kinds), bbox_to_anchor=(0.5, -0.1))
    return save(fig, path)


# ------------------------------------------------------------------------------------ 12 radix tree

@dataclass
class RadixNodeView:
    """One node of the tree as drawn: its words, its KV blocks, and who holds them."""
    depth: int
    words: list[str]
    blocks: list[int]
    held: bool                               # some running sequence's block table has its blocks
    children: list["RadixNodeView"] = field(default_factory=list)


RADIX_SYSTEM = "you are a tutor , answer in one line".split()
RADIX_REQUESTS = {                           # (name, words after the system prompt, still running?)
    "chat 1, turn 1": ("user : what is a kv cache ? bot : keys and values kept".split(), False),
    "chat 1, turn 2": ("user : what is a kv cache ? bot : keys and values kept user : why keep them ?".split(),
                       True),
    "chat 2": ("user : explain paging like i am five please".split(), False),
    "few-shot": ("example : good film -> positive example : dull -> negative".split(), True),
}


def radix_tree_trace(block_size: int = 4) -> tuple[RadixNodeView, dict[str, int]]:
    """A real BlockManager run with prefix_cache="radix": the requests of RADIX_REQUESTS arrive one
    after another, each computes its prompt, and those not marked running finish. Returns the
    tree as drawn and each request's cached prefix tokens at admission."""
    words = list(dict.fromkeys(RADIX_SYSTEM + [w for text, _ in RADIX_REQUESTS.values() for w in text]))
    vocab = {w: i for i, w in enumerate(words)}
    bm = BlockManager(64, block_size, enable_prefix_caching=True, prefix_cache="radix")
    hits = {}
    for name, (text, running) in RADIX_REQUESTS.items():
        req = Request.from_token_ids(name, [vocab[w] for w in RADIX_SYSTEM + text])
        hits[name] = bm.allocate(req)
        req.num_computed_tokens = req.num_tokens                   # prefilled
        bm.cache_blocks(req)
        if not running:
            bm.free(name)
    tree = bm.prefix_cache

    def view(node, depth):
        return RadixNodeView(depth, [words[t] for t in node.tokens], list(node.blocks),
                             any(not tree.is_evictable(b) for b in node.blocks),
                             [view(c, depth + 1) for c in node.children.values()])
    return view(tree.root, 0), hits


def draw_radix_tree(path: Path, prefix_json: Path = ROOT / "results" / "prefix.json") -> Path:
    """Left: the tree of radix_tree_trace; right: hash vs radix on the measured workloads
    (results/prefix.json: hit rate and peak KV blocks held), when that file exists."""
    root, _ = radix_tree_trace()
    fig = new_figure(4.6)
    left, right = fig.subplots(1, 2, width_ratios=(1.6, 1))
    leaves = []

    def place(node):                          # x of a node = the middle of its leaves
        if not node.children:
            leaves.append(node)
            node.x = len(leaves) - 1
        else:
            xs = [place(c) for c in node.children]
            node.x = sum(xs) / len(xs)
        return node.x

    place(root)
    max_depth, stack = 0, [root]
    while stack:
        node = stack.pop()
        max_depth = max(max_depth, node.depth)
        stack += node.children
    w, h = 0.9, 0.62

    def draw(node):
        y = max_depth - node.depth
        if node.depth == 0:
            box(left, node.x - w / 4, y, w / 2, h / 2, "root", COLORS["free"], fontsize=7)
        else:
            lines = [" ".join(node.words[i:i + 4]) for i in range(0, len(node.words), 4)]
            label = "\n".join(lines[:3] + (["..."] if len(lines) > 3 else []))
            box(left, node.x - w / 2, y, w, h, f"{label}\nblocks {node.blocks}",
                COLORS["shared"] if node.held else COLORS["own"], fontsize=5.5)
        for child in node.children:
            arrow(left, (node.x, y), (child.x, max_depth - child.depth + h))
            draw(child)

    draw(root)
    left.set_xlim(-0.6, len(leaves) - 0.4)
    left.set_ylim(-0.2, max_depth + 0.8)
    left.axis("off")
    left.set_title("radix tree after 4 requests (block size 4): yellow held, blue cached only", fontsize=8)
    if prefix_json.is_file():
        rows = [r for r in json.loads(prefix_json.read_text())["results"] if r["pool"] == "roomy"]
        names = list(dict.fromkeys(r["workload"] for r in rows))
        for k, mode in enumerate(("hash", "radix")):
            mine = {r["workload"]: r for r in rows if r["mode"] == mode}
            right.barh([i + 0.4 * k for i in range(len(names))], [mine[n]["peak_blocks_used"] for n in names],
                       height=0.4, color=COLORS["own"] if mode == "hash" else COLORS["shared"], label=mode)
        right.set_yticks([i + 0.2 for i in range(len(names))], names, fontsize=7)
        right.set_xlabel("peak KV blocks held (same hits, same tokens)", fontsize=7)
        right.legend(fontsize=7)
        right.set_title("measured: bench prefix", fontsize=8)
    else:
        right.axis("off")
    return save(fig, path)


# ------------------------------------------------------------------------------------ all of them

FIGURES = {
    "roofline.png": lambda out, quick: draw_roofline(out),
    "bandwidth_over_time.png": lambda out, quick: draw_bandwidth_over_time(out),
    "kv_growth.png": lambda out, quick: draw_kv_growth(out),
    "flash_tiles.png": lambda out, quick: draw_flash_tiles(out),
    "block_table.png": lambda out, quick: draw_block_table(out),
    "batching_gantt.png": lambda out, quick: draw_batching_gantt(out),
    "speculative_timeline.png": lambda out, quick: draw_speculative_timeline(out, quick),
    "radix_tree.png": lambda out, quick: draw_radix_tree(out),
    "parallelism.png": lambda out, quick: draw_parallelism(out),
}


def draw_all(out_dir: Path | str | None = None, quick: bool = False) -> list[Path]:
    """Every figure into out_dir (default lessons/figures); quick: the speculative run on a tiny
    random model instead of SmolLM2."""
    out_dir = Path(out_dir) if out_dir else OUT_DIR
    return [draw(out_dir / name, quick) for name, draw in FIGURES.items()]


# ------------------------------------------------------------------ lesson 11: parallelism

def tp_split_trace(size: int = 3) -> list[tuple[range, range]]:
    """Per rank of shard_model (a tiny model; slicing needs no processes): the rows of the full W_up
    (column-parallel: output features) and the columns of the full W_down (row-parallel: input
    features) that rank holds, found by matching its weights against the full ones."""
    from minillm.parallel.tensor import shard_model

    cfg = tiny_config(n_heads=3, n_kv_heads=3, n_layers=1, dim=12, ffn_dim=18, head_dim=4, vocab_size=30)
    full = random_model(cfg)
    up, down = full.layers[0].ffn.w_up.weight, full.layers[0].ffn.w_down.weight       # (F, d), (d, F)
    spans = []
    for rank in range(size):
        ffn = shard_model(full, rank, size).layers[0].ffn
        n_rows, n_cols = ffn.w_up.weight.shape[0], ffn.w_down.weight.shape[1]
        row = next(i for i in range(up.shape[0] - n_rows + 1) if torch.equal(up[i:i + n_rows], ffn.w_up.weight))
        col = next(j for j in range(down.shape[1] - n_cols + 1) if torch.equal(down[:, j:j + n_cols], ffn.w_down.weight))
        spans.append((range(row, row + n_rows), range(col, col + n_cols)))
    return spans


def draw_parallelism(path: Path, size: int = 3, stages: int = 3, micro: int = 4) -> Path:
    """Left: the FFN's two matrices as shard_model splits them over `size` ranks. Right: GPipe's
    schedule of `micro` micro-batches over `stages` stages, its idle slots the bubble."""
    from minillm.parallel.pipeline import gpipe_schedule
    from minillm.course.calculators import bubble_fraction

    fig = new_figure(3.6)
    left, right = fig.subplots(1, 2, width_ratios=[1.1, 1])
    rank_colors = ["#8fb8de", "#f2c85b", "#8fd18f", "#e58a8a"]
    spans = tp_split_trace(size)
    F, d = spans[-1][0].stop, 12
    for r, (rows, cols) in enumerate(spans):      # W_up (F x d) drawn with rows as bands; W_down (d x F) columns
        box(left, 0, F - rows.stop, d / 2, len(rows), f"rank {r}\nrows {rows.start}-{rows.stop - 1}", rank_colors[r], 7)
        box(left, 9 + cols.start, F / 2 - d / 4, len(cols), d / 2, f"rank {r}\ncols {cols.start}-{cols.stop - 1}",
            rank_colors[r], 7)
    left.text(d / 4, F + 0.8, "W_up, W_gate: column-parallel\n(split outputs: no communication)", ha="center", fontsize=8)
    left.text(9 + F / 2, F / 2 + d / 4 + 0.8, "W_down, o_proj: row-parallel\n(split inputs: partial sums)",
              ha="center", fontsize=8)
    arrow(left, (d / 2 + 0.3, F / 2), (8.7, F / 2))
    left.text(9 + F / 2, F / 2 - d / 4 - 2.2, "one all-reduce adds the partial sums", ha="center", fontsize=8)
    left.set_xlim(-0.5, 9 + F + 0.5)
    left.set_ylim(-3, F + 3.5)
    left.axis("off")
    left.set_title(f"tensor parallel FFN over {size} ranks (from shard_model)", fontsize=9)
    for s, j, t in gpipe_schedule(stages, micro):
        box(right, t, stages - 1 - s, 1, 0.8, f"mb {j}", rank_colors[j % len(rank_colors)], 7)
    span = micro + stages - 1
    for s in range(stages):
        right.text(-0.2, stages - 1 - s + 0.4, f"stage {s}", ha="right", va="center", fontsize=7)
    right.set_xlim(-1.6, span + 0.2)
    right.set_ylim(-0.4, stages + 0.2)
    right.set_xlabel("time (one slot = one micro-batch through one stage)", fontsize=7)
    right.set_yticks([])
    right.set_title(f"GPipe, p={stages}, m={micro}: idle (p-1)/(m+p-1) = {bubble_fraction(stages, micro):.0%} "
                    f"of {span} slots", fontsize=9)
    return save(fig, path)
