"""One request alone on the contiguous KV cache: the reference the engine is tested against.

    for delta in stream_contiguous(llm, req): ...

This is lesson 02's stage: one sequence, one preallocated cache, no paging; its batch-1 fast loop
(fast_decode.forward_fast) for a fused float model, the compiled step over int8/int4 packs
(fast_decode.forward_quantized) for a quantised one, kv_cache.forward_cached otherwise. It uses the
engine's output processor, so that sampling, stop rules, logprobs and detokenising are compared on
equal terms. With llm.speculative_method set, the request runs the
per-request speculative loop of lesson 08 (minillm/speculative.py) instead. LLM itself never takes
this path: every request goes through the engine.
"""
from __future__ import annotations

from typing import Iterator

import torch

from .fast_decode import forward_fast, forward_quantized, is_fused, quantized_step_ready
from .kv_cache import KVCache, forward_cached
from .positions import RopeTable
from .request import Request


@torch.no_grad()
def stream_contiguous(llm, req: Request) -> Iterator[str]:
    """Run one request of `llm` (from llm.make_requests) to completion, yielding its new visible
    text after every token."""
    if llm.speculative_method is not None:
        from .speculative import SpecStats, speculative_stream
        spec = llm.engine_config.speculative
        yield from speculative_stream(llm, req, spec.method, spec.num_speculative_tokens, SpecStats())
        return
    room = min(llm.max_model_len, len(req.prompt_token_ids) + req.params.max_tokens)
    cache = KVCache(llm.config, 1, room, llm.model.embed.weight.dtype, llm.device)
    model, rope = llm.model, RopeTable(llm.config.head_dim, llm.config.rope_theta, room, llm.device)
    if is_fused(model):
        step = lambda t: forward_fast(model, t, cache, rope, llm.attention_backend)  # noqa: E731
    elif quantized_step_ready(model):
        step = lambda t: forward_quantized(model, t, cache, rope)  # noqa: E731
    else:
        step = lambda t: forward_cached(model, t, cache)  # noqa: E731
    prompt = torch.tensor([req.prompt_token_ids], device=llm.device)              # (1, T)
    if req.params.prompt_logprobs is not None:
        logits = forward_cached(model, prompt, cache, all_logits=True)[0]         # (T, V)
        llm.output_processor.set_prompt_logprobs(req, logits)
        logits = logits[-1]
    else:
        logits = step(prompt)[0]                                                  # (V,)
    computed = len(req.prompt_token_ids)
    while True:
        yield llm.output_processor.append(req, logits)
        if req.finished:
            return
        new = req.all_token_ids[computed:]        # the sampled token (+ any jump-forward tokens)
        computed += len(new)
        logits = step(prompt.new_tensor([new]))[0]                                # (V,) after the last of them
