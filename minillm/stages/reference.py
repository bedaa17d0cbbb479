"""One request alone on the contiguous KV cache: the reference the engine is tested against.

    for delta in stream_contiguous(llm, req): ...

This is lesson 02's stage: one sequence, one preallocated cache, no paging, run by lesson 02's
batch-1 forward (fast_decode.FastDecoder: the fast loop and compiled step for a fused float model,
the compiled step over int8/int4 packs for a quantised one, kv_cache.forward_cached otherwise). It
uses the engine's output processor, so that sampling, stop rules, logprobs and detokenising are
compared on equal terms. With llm.speculative_method set, the request runs the per-request
speculative loop of lesson 08 (minillm/stages/speculative_loop.py) instead. LLM itself never takes this
path: every request goes through the engine.
"""
from __future__ import annotations

from typing import Iterator

import torch

from minillm.engine.request import Request
from minillm.model.positions import RopeTable
from .fast_decode import FastDecoder
from .kv_cache import KVCache, forward_cached


@torch.no_grad()
def stream_contiguous(llm, req: Request, decoder: FastDecoder | None = None) -> Iterator[str]:
    """Run one request of `llm` (from llm.make_requests) to completion, yielding its new visible
    text after every token. decoder: a FastDecoder of llm.model to reuse across requests (None:
    one is built for this request; for a quantised model that packs its weights every time)."""
    if decoder is None:
        decoder = FastDecoder(llm.model, attention_backend=llm.attention_backend)
    if llm.speculative_method is not None:
        from minillm.speculative.core import SpecStats
        from .speculative_loop import speculative_stream
        spec = llm.engine_config.speculative
        yield from speculative_stream(llm, req, spec.method, spec.num_speculative_tokens, SpecStats(),
                                      decoder=decoder)
        return
    room = min(llm.max_model_len, len(req.prompt_token_ids) + req.params.max_tokens)
    cache = KVCache(llm.config, 1, room, llm.model.embed.weight.dtype, llm.device)
    rope = RopeTable(llm.config.head_dim, llm.config.rope_theta, room, llm.device, llm.config.rope_scaling)
    prompt = torch.tensor([req.prompt_token_ids], device=llm.device)              # (1, T)
    if req.params.prompt_logprobs is not None:
        logits = forward_cached(llm.model, prompt, cache, all_logits=True)[0]     # (T, V)
        llm.output_processor.set_prompt_logprobs(req, logits)
        logits = logits[-1]
    else:
        logits = decoder.forward(prompt, cache, rope)[0]                          # (V,)
    computed = len(req.prompt_token_ids)
    while True:
        yield llm.output_processor.append(req, logits)
        if req.finished:
            return
        new = req.all_token_ids[computed:]        # the sampled token (+ any jump-forward tokens)
        computed += len(new)
        logits = decoder.forward(prompt.new_tensor([new]), cache, rope)[0]        # (V,) after the last of them
