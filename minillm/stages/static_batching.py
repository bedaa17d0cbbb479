"""Static batching: the baseline continuous batching is measured against (lesson 07).

What HF's batched `generate` does: take a batch, pad every prompt to the longest, prefill them
together, then decode ALL rows every step until the LONGEST request has its tokens. A row
whose request is done keeps computing padding; the next batch waits for the whole batch.
The cost is visible in two numbers this function returns: `useful_tokens` (what the
requests asked for) vs `computed_tokens` (rows x steps).

Greedy only: it is a throughput baseline, and its tokens are checked against the engine's.
Runs on minillm's contiguous KV cache (minillm/stages/kv_cache.py), batch rows right-padded.
"""
from __future__ import annotations

import time

import torch

from minillm.model.llama import Llama
from .kv_cache import KVCache, forward_cached


@torch.no_grad()
def generate_static(model: Llama, prompts: list[list[int]], max_tokens: list[int], batch_size: int,
                    eos_token_id: int | None = None) -> dict:
    """Greedy-decode prompts in fixed batches of batch_size, in order.

    Returns {"token_ids": per request, "first_token_time"/"finish_time": per request
    (time.perf_counter() seconds), "useful_tokens", "computed_tokens", "steps"}. A request's
    finish_time is its batch's: static batching hands results back a batch at a time.
    eos_token_id: stop a row at EOS (None: every row produces exactly its max_tokens).
    """
    if len(prompts) != len(max_tokens) or not prompts:
        raise ValueError("need one max_tokens per prompt, and at least one prompt")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size = {batch_size!r} is invalid; allowed: an integer >= 1")
    device = model.embed.weight.device
    dtype = model.embed.weight.dtype
    out = {"token_ids": [None] * len(prompts), "first_token_time": [None] * len(prompts),
           "finish_time": [None] * len(prompts), "useful_tokens": sum(max_tokens), "computed_tokens": 0,
           "steps": 0}
    for first in range(0, len(prompts), batch_size):
        idx = list(range(first, min(first + batch_size, len(prompts))))
        batch = [prompts[i] for i in idx]
        B, longest = len(batch), max(map(len, batch))
        steps = max(max_tokens[i] for i in idx)                          # until the longest is done
        lengths = torch.tensor([len(p) for p in batch], device=device)
        tokens = torch.zeros(B, longest, dtype=torch.long, device=device)   # (B, T) right-padded
        for b, p in enumerate(batch):
            tokens[b, :len(p)] = torch.tensor(p)
        cache = KVCache(model.cfg, B, longest + steps, dtype, device)
        logits = forward_cached(model, tokens, cache, num_new=lengths)      # (B, V)
        done = [False] * B
        rows = [[] for _ in range(B)]
        for step in range(steps):
            nxt = logits.argmax(-1)                                          # (B,)
            now = time.perf_counter()
            for b, i in enumerate(idx):
                if done[b]:
                    continue                                                 # computed, thrown away
                rows[b].append(int(nxt[b]))
                if step == 0:
                    out["first_token_time"][i] = now
                if len(rows[b]) >= max_tokens[i] or rows[b][-1] == eos_token_id:
                    done[b] = True
            out["computed_tokens"] += B
            out["steps"] += 1
            if step + 1 < steps:
                logits = forward_cached(model, nxt[:, None], cache)         # every row, done or not
        end = time.perf_counter()
        for b, i in enumerate(idx):
            out["token_ids"][i], out["finish_time"][i] = rows[b], end
    return out
