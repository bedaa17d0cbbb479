"""From logits to what the user sees: sampling, stop rules, detokenising, logprobs, outputs.

The engine's step ends here (vLLM v1's output processor): for each request that got logits it
samples (or takes a token a speculative verifier chose), appends it, and applies the stop rules;
the text that is safe to show comes back as a delta to stream. Nothing here knows about batches,
blocks or the model: one request and one row of logits at a time.

    processor = OutputProcessor(tokenizer, max_model_len)
    delta = processor.append(req, logits)          # logits (V,) of the request's last token
    processor.to_output(req)                       # RequestOutput with vLLM's names
"""
from __future__ import annotations

import time

import torch

from .outputs import CompletionOutput, Logprob, RequestOutput
from .request import Request
from .sampling import sample


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def append(self, req: Request, logits: torch.Tensor, token: int | None = None) -> str:
        """Sample from logits (V,) (or take `token`, chosen by a verifier), append, update
        text/stop state. Returns the new visible text. logits feed the logprobs either way.

        Guided requests sample from the logits with the grammar's forbidden tokens at -inf;
        their logprobs are the model's own (raw, unmasked) distribution, like vLLM's default.
        With jump-forward, the tokens the grammar then forces are appended too, unsampled."""
        guide = req.guide
        if token is None:
            token = sample(logits if guide is None else guide.masked(logits), req.params, req.generator)
        self._push(req, token, logits)
        if guide is not None and guide.jump_forward and not req.finished:
            for forced in guide.forced_tokens():
                self._push(req, forced, None)
                guide.num_forced_tokens += 1
                if req.finished:
                    break
        return visible_delta(req)

    def _push(self, req: Request, token: int, logits: torch.Tensor | None) -> None:
        """Append one token and apply the stop rules (logits None: a jump-forward token)."""
        if req.guide is not None:
            req.guide.advance(token)
        now = time.time()
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.output_token_ids.append(token)
        if req.params.logprobs is not None:
            entry, lp = logprob_entry(logits, token, req.params.logprobs, self.tokenizer)
            req.output_logprobs.append(entry)
            req.cumulative_logprob += lp
        params = req.params
        if not params.ignore_eos and token == self.tokenizer.eos_token_id:
            req.finish_reason, req.stop_reason = "stop", None
        elif token in params.stop_token_ids:
            req.finish_reason, req.stop_reason = "stop", token
        if not req.finished and (len(req.output_token_ids) >= params.max_tokens
                                 or len(req.all_token_ids) >= self.max_model_len):
            req.finish_reason = "length"
        checked = len(req.text)
        self.detokenize(req, flush=req.finished)
        for s in params.stop:                 # only where a new match can be: text before `checked` was searched
            at = req.text.find(s, max(0, checked - len(s) + 1))
            if at != -1:
                req.text = req.text[:at]
                req.finish_reason, req.stop_reason = "stop", s       # the text after it, read or not, is cut
                break
        if req.finished:
            req.metrics.finished_time = now
        req.metrics.num_generated_tokens = len(req.output_token_ids)

    def detokenize(self, req: Request, flush: bool = False) -> None:
        """Append the text of the newest output tokens to req.text without decoding the whole output again (that
        would cost O(n) per token, O(n^2) per request). Decode a short window of tokens that ends at the newest one,
        with and without the tokens not yet read: the difference is their text. The window starts a token or more
        back so that a decoder that treats a sequence's first token specially (a leading space) sees the same
        context as in the whole output. A window that ends inside a multi-byte character decodes to U+FFFD: those
        tokens wait for the next one, unless `flush` (the request is over: take the text as it decodes)."""
        ids = req.output_token_ids
        if req.detok_read >= len(ids):
            return
        before = self.tokenizer.decode(ids[req.detok_window:req.detok_read])
        after = self.tokenizer.decode(ids[req.detok_window:])
        if after.endswith("\ufffd") and not flush:
            return
        req.text += after[len(before):]
        req.detok_window, req.detok_read = req.detok_read, len(ids)

    def set_prompt_logprobs(self, req: Request, prompt_logits: torch.Tensor) -> None:
        """prompt_logits (T, V): position t predicts token t + 1."""
        k = req.params.prompt_logprobs
        entries = [None]
        for t in range(1, len(req.prompt_token_ids)):
            entries.append(logprob_entry(prompt_logits[t - 1], req.prompt_token_ids[t], k, self.tokenizer)[0])
        req.prompt_logprobs = entries

    @staticmethod
    def to_output(req: Request) -> RequestOutput:
        completion = CompletionOutput(
            index=0, text=req.text, token_ids=list(req.output_token_ids),
            cumulative_logprob=req.cumulative_logprob if req.params.logprobs is not None else None,
            logprobs=req.output_logprobs, finish_reason=req.finish_reason, stop_reason=req.stop_reason)
        return RequestOutput(request_id=req.request_id, prompt=req.prompt,
                             prompt_token_ids=req.prompt_token_ids, prompt_logprobs=req.prompt_logprobs,
                             outputs=[completion], finished=req.finished, metrics=req.metrics,
                             num_cached_tokens=req.num_cached_tokens)


def logprob_entry(logits: torch.Tensor, token: int, k: int, tokenizer) -> tuple[dict[int, Logprob], float]:
    """{token: Logprob} for the chosen token plus the k most likely ones (raw logits, no temperature)."""
    logp = logits.float().log_softmax(-1)                              # (V,)
    chosen = float(logp[token])
    rank = int((logp > logp[token]).sum()) + 1
    entry = {token: Logprob(chosen, rank, tokenizer.decode([token], skip_special_tokens=False))}
    if k:
        top = torch.topk(logp, k)
        for r, (v, i) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            entry.setdefault(i, Logprob(v, r, tokenizer.decode([i], skip_special_tokens=False)))
    return entry, chosen


def visible_delta(req: Request) -> str:
    """Text not yet shown that is safe to show. While running, hold back a trailing partial
    UTF-8 character (decoded as U+FFFD) and the last len(stop) - 1 characters, which could still
    turn out to be the start of a stop string."""
    visible = req.text
    if not req.finished:
        visible = visible.rstrip("\ufffd")
        hold = max((len(s) - 1 for s in req.params.stop), default=0)
        visible = visible[:len(visible) - hold]
    delta = visible[req.emitted:]
    req.emitted = max(req.emitted, len(visible))
    return delta
