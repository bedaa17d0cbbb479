"""Small shared pieces for tests (import as `from helpers import ...`; tests/ is on sys.path)."""
import contextlib
import logging
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minillm.stages.reference import stream_contiguous


class CharTokenizer:
    """Just enough tokenizer for the tiny random model: id -> one printable character."""
    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(33 + i % 90) for i in ids if not (skip_special_tokens and i == self.eos_token_id))


def random_prompts(lengths, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


class LargestNewTensor(TorchDispatchMode):
    """Records the largest tensor any operation creates inside the `with` block (views share
    memory: not counted). Proves what an algorithm never materialises."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel())
        return out


def count_calls(monkeypatch, name, *modules) -> list:
    """Replace function `name` in each of `modules` that has it (the defining module first) by a
    wrapper that records each call and then runs the original. Returns the list of recorded calls:
    a test that names a code path can then prove the path ran, not a fallback with the same result."""
    original = getattr(modules[0], name)
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    for module in modules:
        if getattr(module, name, None) is original:
            monkeypatch.setattr(module, name, wrapper)
    return calls


def alone(llm, prompts, params):
    """Each request by itself on the contiguous single-sequence path (the engine tests' reference),
    one lesson-02 decoder for all of them (a quantised model packs its weights once)."""
    from minillm.stages.fast_decode import FastDecoder

    decoder = FastDecoder(llm.model, attention_backend=llm.attention_backend)
    outs = []
    for prompt, p in zip(prompts, params):
        (req,) = llm.make_requests([prompt], p)
        for _ in stream_contiguous(llm, req, decoder):
            pass
        outs.append(req.output_token_ids)
    return outs


def greedy_under_naive_forward(model, prompt_ids, generated, tie=1e-4) -> bool:
    """Whether every generated token is the naive forward's greedy choice given everything before it,
    to within a near-tie (its logit at most `tie` below the largest). Teacher-forced: the forward is
    causal, so ONE no-cache forward of prompt + generated gives every decode step's logits (a greedy
    run of n tokens is checked in one pass, not n). A near-tie passes, and the check continues on
    the run's own tokens."""
    with torch.inference_mode():
        logits = model(torch.tensor([list(prompt_ids) + list(generated)]))[0, len(prompt_ids) - 1:-1].float()  # (n, V)
    chosen = logits.gather(1, torch.tensor(generated).view(-1, 1))[:, 0]                                   # (n,)
    return bool((chosen >= logits.max(-1).values - tie).all())


@contextlib.contextmanager
def symbols_created():
    """Yields a list that collects the size symbols Dynamo creates inside the block (its
    "create_symbol ... for L['x'].size()[d] ..." log lines): which sizes a compile made symbolic."""
    symbols = []

    def keep(record):
        if record.getMessage().startswith("create_symbol"):
            symbols.append(record.getMessage())

    handler = logging.Handler()
    handler.emit = keep
    log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = log.level
    log.addHandler(handler), log.setLevel(logging.INFO)
    try:
        yield symbols
    finally:
        log.removeHandler(handler), log.setLevel(level)


# The teaching stages (minillm/stages/): the engine must never enter them.
TEACHING_STAGES = {"minillm.stages.kv_cache", "minillm.stages.fast_decode", "minillm.stages.speculative_loop",
                   "minillm.stages.reference", "minillm.stages.static_batching"}


def modules_entered(fn, below=None) -> set[str]:
    """minillm modules whose functions are called while fn() runs; below: a code object, then only
    calls made inside it."""
    seen, depth = set(), [0]

    def hook(frame, event, arg):
        if frame.f_code is below:
            depth[0] += 1 if event == "call" else -1 if event == "return" else 0
        if event == "call" and (below is None or depth[0] > 0):
            name = frame.f_globals.get("__name__", "")
            if name.startswith("minillm"):
                seen.add(name)

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson goodness of fit over the bins with p > 0 (p-value from the chi-square survival
    function Q(df/2, x/2), the regularised upper incomplete gamma)."""
    n = counts.sum()
    keep = probs > 0
    expected = n * probs[keep].double()
    stat = ((counts[keep].double() - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def second_token_marginal(model, prompt: list[int], temperature: float = 1.0) -> torch.Tensor:
    """The exact distribution (V,) of the second token sampled at `temperature` after `prompt`:
    p(x2) = sum_x1 p(x1) p(x2 | x1), from the model's own logits (the speculative tests' reference)."""
    V = model.cfg.vocab_size
    with torch.no_grad():
        p1 = (model(torch.tensor([prompt]))[0, -1] / temperature).softmax(-1)                            # (V,)
        after = (model(torch.tensor([prompt + [x] for x in range(V)]))[:, -1] / temperature).softmax(-1)  # (V, V)
    return (p1[:, None] * after).sum(0)                                                # (V,)


def sampled_second_tokens(llm, prompt: list[int], n: int, temperature: float = 1.0) -> torch.Tensor:
    """The second token of n requests for `prompt` sampled at `temperature` (seeds 0 .. n - 1), by llm.generate
    -> (n,)."""
    from minillm import SamplingParams
    params = [SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True, seed=s) for s in range(n)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    return torch.tensor([o.outputs[0].token_ids[1] for o in outs])


def paged_case(lengths, num_heads, num_kv_heads, head_dim=16, block_size=4, dtype=torch.float32, seed=0):
    """q (B, Hq, D), a pool whose blocks are scattered and filled with noise, int64 block tables
    (B, n) padded with block 0, and seq_lens (B,)."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in lengths]
    num_blocks = sum(per_seq) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(lengths), max(per_seq), dtype=torch.long)
    for row, nb in enumerate(per_seq):
        tables[row, :nb] = torch.tensor(order[:nb])
        order = order[nb:]
    q = torch.randn(len(lengths), num_heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lengths)


def tiny_hf_model(config_class, model_class, config: dict):
    """A tiny random-weight transformers model: norm weights near 1, the rest N(0, 0.2); a DeepSeek router's
    balance bias N(0, 0.1), so that it changes choices."""
    model = model_class(config_class(**config))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen) if "norm" in name else
                    0.2 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    return model.eval()


def hf_folders(tmp_path_factory, tokenizer, models: dict) -> dict:
    """name -> (an HF folder with config.json, safetensors and the tokenizer, the transformers model)."""
    out = {}
    for name, model in models.items():
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        out[name] = folder, model
    return out


@torch.no_grad()
def hf_greedy(hf, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy tokens by transformers' forward over the whole sequence each step (no cache)."""
    out = []
    for p in prompts:
        ids = list(p)
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        out.append(ids[len(p):])
    return out
