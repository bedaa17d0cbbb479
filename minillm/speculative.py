"""Speculative decoding: a cheap draft guesses k tokens, the target checks all of them in ONE forward.

Plain decoding runs the target once per token. At batch 1 a decode step is bound by reading the
weights (or, on a small CPU model, by Python overhead), so a forward over k + 1 positions costs
about as much as a forward over 1. Speculative decoding spends that spare capacity:

    1. the draft proposes d_1 .. d_k (draft model: k cheap steps; n-gram lookup: a search)
    2. the target runs [last token, d_1 .. d_k] in one call -> k + 1 distributions p_0 .. p_k
    3. the rejection sampler keeps the longest accepted prefix d_1 .. d_n and adds one token of
       its own (a correction at n < k, a bonus from p_k at n = k): every target call yields
       between 1 and k + 1 tokens
    4. both KV caches roll back the positions of rejected guesses

The rule that makes the output exactly the target's (Leviathan et al. 2023, Chen et al. 2023):
accept d ~ q with probability min(1, p(d) / q(d)); on rejection sample from norm(max(0, p - q)).
P(emit x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) * max(0, p(x) - q(x)) / Z
          = min(q(x), p(x)) + max(0, p(x) - q(x)) = p(x),   since Z = 1 - sum_y min(p(y), q(y)).
At temperature 0 p and q are one-hot at their argmax, and the rule becomes "accept while the
draft's token is the target's argmax": greedy verification, token-identical to greedy decoding.

Three drafts (make_draft):
    "draft"      a separate, cheaper model derived from the target: a bfloat16 copy of all
                 its weights with its own KV cache (the benchmark measures why this one)
    "layerskip"  self-speculative: the target itself with some middle layers skipped,
                 sharing the target's weights (Zhang et al. 2023, "Draft & Verify")
    "ngram"      prompt lookup: no model; find the last few tokens earlier in the context
                 and propose what followed them there (Saxena 2023)

speculative_stream(llm, req, method, k) is the per-request runner LLM uses: it behaves like
LLM.stream_request and yields the visible text after every appended token.
"""
from __future__ import annotations

import dataclasses
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from .fast_decode import can_compile_step, forward_fast, forward_verify, fuse_projections, is_fused
from .kv_cache import KVCache, forward_cached
from .model import Llama
from .positions import RopeTable
from .roofline import expected_tokens_per_call
from .sampling import SamplingParams, filtered_probs

METHODS = ("draft", "layerskip", "ngram")
MAX_SPECULATIVE_TOKENS = 16
POLICIES = ("adaptive", "always")   # how many drafts a round gets: as many as pay, or always k
COST_WINDOW = 64                    # recent steps the cost model is fitted to


# ---- the verification rules: the part that makes speculation exact ---------------------------------

def greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature 0. draft_tokens (B, k); target_logits (B, k+1, V).

    Returns tokens (B, k+1) and num_accepted (B,): row b emits tokens[b, :num_accepted[b] + 1].
    The target's argmax at every position IS what greedy decoding would emit there, as long as
    every earlier draft token matched; the first mismatch is replaced by the target's choice."""
    # BEGIN SOLUTION rejection_sampler
    # HINT: the target's choice at every position is argmax of its logits (B, k+1). The number
    # HINT: accepted is the count of LEADING positions where the draft equals that choice (a cumulative
    # HINT: product of the matches does it without a loop). The tokens are simply the target's choices.
    k = draft_tokens.shape[1]
    choice = target_logits.argmax(-1)                                   # (B, k+1)
    match = draft_tokens == choice[:, :k]                               # (B, k)
    num_accepted = match.long().cumprod(-1).sum(-1)                     # (B,) leading matches
    return choice, num_accepted
    # END SOLUTION


def rejection_sample(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature > 0. draft_tokens (B, k) drawn from draft_probs (B, k, V); target_probs (B, k+1, V).

    Returns tokens (B, k+1) and num_accepted (B,): row b emits tokens[b, :num_accepted[b] + 1],
    and that sequence is distributed exactly as k + 1 tokens sampled from the target one by one."""
    # BEGIN SOLUTION rejection_sampler
    # HINT: accept d_i with probability min(1, p(d_i) / q(d_i)): draw u ~ U(0, 1) per position (with
    # HINT: `generator`) and accept when u * q(d_i) < p(d_i); num_accepted = leading accepts. The one
    # HINT: extra token is sampled from norm(max(0, p - q)) at the first rejected position, or from
    # HINT: p_k (the bonus) when all k were accepted (torch.multinomial with `generator`). Output
    # HINT: tokens (B, k+1): the draft tokens, with the extra token written at index num_accepted.
    B, k = draft_tokens.shape
    rows = torch.arange(B, device=draft_tokens.device)
    p_d = target_probs[:, :k].gather(-1, draft_tokens[..., None])[..., 0]   # (B, k) p(d_i)
    q_d = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]           # (B, k) q(d_i) > 0
    u = torch.rand(B, k, generator=generator, device=draft_tokens.device)  # (B, k)
    accept = u * q_d < p_d                                              # P = min(1, p/q)
    num_accepted = accept.long().cumprod(-1).sum(-1)                    # (B,) leading accepts
    # The one token the target adds: from the residual where the first rejection happened,
    # or from p_k itself (the bonus) when all k were accepted.
    residual = (target_probs[:, :k] - draft_probs).clamp(min=0)         # (B, k, V) max(0, p - q)
    extra = torch.cat([residual, target_probs[:, k:]], dim=1)           # (B, k+1, V)
    dist = extra[rows, num_accepted]                                    # (B, V)
    mass = dist.sum(-1, keepdim=True)                                   # (B, 1)
    # A rejection means p(d) < q(d), so the residual has mass; 0 can only come from rounding.
    dist = torch.where(mass > 0, dist / mass.clamp(min=1e-30), target_probs[rows, num_accepted])
    last = torch.multinomial(dist, 1, generator=generator)[:, 0]        # (B,)
    tokens = torch.cat([draft_tokens, last[:, None]], dim=1)            # (B, k+1)
    tokens[rows, num_accepted] = last
    return tokens, num_accepted
    # END SOLUTION


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """alpha = sum_x min(p(x), q(x)): the chance one drafted token is accepted. p, q (..., V)."""
    return torch.minimum(p, q).sum(-1)


def expected_speedup(alpha: float, k: int, cost_ratio: float, verify_cost: float = 1.0) -> float:
    """Leviathan et al.: tokens per call / (k * c + v), c = draft step time / target step time and
    v = the time of a target call over k + 1 positions in target steps (they assume v = 1; lesson 08
    measures it well above 1 on a CPU)."""
    return expected_tokens_per_call(alpha, k) / (k * cost_ratio + verify_cost)


def best_k(alpha: float, cost_ratio: float, max_k: int = MAX_SPECULATIVE_TOKENS, verify_cost: float = 1.0) -> int:
    """The number of guesses (1..max_k) with the highest expected_speedup: more guesses pay only while
    alpha^k is not negligible next to the cost k * c of drafting them."""
    return max(range(1, max_k + 1), key=lambda k: expected_speedup(alpha, k, cost_ratio, verify_cost))


# ---- the adaptive policy: how many drafts pay (batch 1 here; the engine's batch: speculative_engine.py) ----

class StepCostModel:
    """t(N) = a + b N seconds for a step over N tokens: least squares over the last COST_WINDOW
    steps. None until the steps seen span at least two token counts (then the policy explores)."""

    def __init__(self, window: int = COST_WINDOW):
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, num_tokens: int, seconds: float) -> None:
        self.samples.append((num_tokens, seconds))

    def fit(self) -> tuple[float, float] | None:
        """(a, b), both >= 0, or None while the token counts seen do not vary."""
        if len(self.samples) < 4:
            return None
        n = torch.tensor([s[0] for s in self.samples], dtype=torch.float64)       # (W,)
        t = torch.tensor([s[1] for s in self.samples], dtype=torch.float64)       # (W,)
        spread = float(((n - n.mean()) ** 2).sum())
        if spread < 1.0 or float(n.max() - n.min()) < 2:
            return None
        b = max(0.0, float(((n - n.mean()) * (t - t.mean())).sum()) / spread)
        a = max(0.0, float(t.mean()) - b * float(n.mean()))
        return a, b


def plan_draft_lengths(alphas: list[float], max_ks: list[int], base_tokens: int, base_yield: float,
                       cost: tuple[float, float] | None, draft_seconds_per_token: float = 0.0) -> list[int]:
    """How many drafts each decoding request should carry this step.

    alphas[i]: request i's estimated acceptance probability; max_ks[i]: the most it may carry;
    base_tokens: tokens the step runs without drafts; base_yield: tokens it yields without them
    (one per decoding request); cost: (a, b) of t(N) = a + b N, or None (unknown: take max_ks).
    Greedy: the candidate drafts sorted by gain alpha_i^j, each taken while
    gain / (b + c) > E / t (minillm/speculative_engine.py derives it); the gains of one request fall with j,
    so its drafts are taken in order."""
    if cost is None:
        return list(max_ks)
    a, b = cost
    per_draft = b + draft_seconds_per_token
    candidates = sorted(((alpha ** j, i) for i, (alpha, k) in enumerate(zip(alphas, max_ks))
                         for j in range(1, k + 1)), reverse=True)
    ks = [0] * len(alphas)
    expected, seconds = float(base_yield), a + b * base_tokens
    for gain, i in candidates:
        if per_draft > 0 and gain * seconds <= per_draft * expected:
            break                                   # the best remaining draft no longer pays
        ks[i] += 1
        expected, seconds = expected + gain, seconds + per_draft
    return ks


# ---- drafts ---------------------------------------------------------------------------------------

class Stepper:
    """One sequence's KV cache plus the batch-1 forward that extends it: the fast path
    (minillm/fast_decode.py) when the model's projections are fused, as LLM does, else the baseline."""

    def __init__(self, model: Llama, max_len: int):
        weight = model.embed.weight
        self.model = model
        self.cache = KVCache(model.cfg, 1, max_len, weight.dtype, weight.device)
        self.rope = RopeTable(model.cfg.head_dim, model.cfg.rope_theta, max_len, weight.device) \
            if is_fused(model) else None

    @property
    def length(self) -> int:
        return int(self.cache.lengths[0])

    def step(self, tokens: list[int]) -> torch.Tensor:
        """Feed tokens; logits (V,) of the last one."""
        ids = torch.tensor([tokens], device=self.cache.k.device)          # (1, T)
        if self.rope is not None:
            return forward_fast(self.model, ids, self.cache, self.rope)[0]
        return forward_cached(self.model, ids, self.cache)[0]

    def step_all(self, tokens: list[int]) -> torch.Tensor:
        """Feed tokens; logits (T, V) of every one (verification needs all k + 1): k + 1 tokens by
        the compiled verification step (fast_decode item 7) where it applies, else (a longer run,
        such as a prompt whose logprobs are asked for, or the baseline model) by forward_cached."""
        ids = torch.tensor([tokens], device=self.cache.k.device)          # (1, T)
        if self.rope is not None and len(tokens) <= MAX_SPECULATIVE_TOKENS + 1 \
                and can_compile_step(self.model, ids.device):
            return forward_verify(self.model, ids, self.cache, self.rope)
        return forward_cached(self.model, ids, self.cache, all_logits=True)[0]

    def rollback(self, length: int) -> None:
        """Forget cached positions >= length (rejected guesses)."""
        self.cache.truncate(torch.tensor([length], device=self.cache.lengths.device))


def layer_subset(model: Llama, keep: list[int]) -> Llama:
    """A Llama that runs only model.layers[i] for i in keep; every weight is shared, none copied."""
    with torch.device("meta"):
        sub = Llama(dataclasses.replace(model.cfg, n_layers=0))        # no layers, embed on meta
    sub.cfg = dataclasses.replace(model.cfg, n_layers=len(keep))
    sub.embed, sub.norm, sub.lm_head = model.embed, model.norm, model.lm_head
    sub.layers = nn.ModuleList(model.layers[i] for i in keep)
    return sub.eval()


def default_skipped_layers(n_layers: int) -> list[int]:
    """Which layers the self-speculative draft skips: n_layers // 7 of them (at least one),
    every other layer around the middle. SmolLM2-135M has no layer to spare: skipping any single
    one already changes the greedy token often (layers 0 and 1 most, the middle least; the
    benchmark's layer table measures it), so the draft skips only a few middle ones."""
    count = max(1, n_layers // 7)
    start = n_layers // 2 - count + 1
    return list(range(start, start + 2 * count - 1, 2))


class NgramDraft:
    """Prompt lookup decoding: no model. Match the last n tokens (n = max_n .. min_n) against the
    earlier context; on the most recent match propose the k tokens that followed it."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not (isinstance(min_n, int) and isinstance(max_n, int) and 1 <= min_n <= max_n):
            raise ValueError(f"ngram sizes min_n = {min_n!r}, max_n = {max_n!r} are invalid; "
                             f"allowed: integers with 1 <= min_n <= max_n")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, context: list[int], k: int, params: SamplingParams, generator) -> tuple[list[int], None]:
        """Up to k tokens and q = None: the proposal is deterministic, q is one-hot on it.
        Each n is one vectorised comparison of every earlier n-gram with the last one."""
        ids = torch.tensor(context, dtype=torch.long)                  # (L,)
        for n in range(min(self.max_n, len(context) - 1), self.min_n - 1, -1):
            earlier = ids[:-1].unfold(0, n, 1)                          # (L-n, n): n-grams ending before the last token
            starts = (earlier == ids[-n:]).all(-1).nonzero()            # (matches, 1), in context order
            if len(starts):
                start = int(starts[-1])                                 # latest match first
                return context[start + n:start + n + k], None
        return [], None

    def rollback(self, length: int) -> None:
        """Nothing to roll back: the lookup keeps no state."""


class ModelDraft:
    """A draft language model with its own KV cache (a separate model or a layer subset)."""

    def __init__(self, model: Llama):
        self.model = model
        self.state: Stepper | None = None

    def reset(self, max_len: int) -> None:
        self.state = Stepper(self.model, max_len)

    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator) -> tuple[list[int], torch.Tensor | None]:
        """k tokens drafted one by one, and q (k, V) they were drawn from (None when greedy)."""
        if k == 0:
            return [], None
        logits = self.state.step(context[self.state.length:])            # (V,): unseen tail, >= 1 token
        tokens, qs = [], []
        for i in range(k):
            if params.greedy:
                token = int(logits.argmax())
            else:
                q = filtered_probs(logits, params)                      # (V,)
                token = int(torch.multinomial(q, 1, generator=generator))
                qs.append(q)
            tokens.append(token)
            if i + 1 < k:                                               # d_k itself is never fed
                logits = self.state.step([token])
        return tokens, (torch.stack(qs) if qs else None)

    def rollback(self, length: int) -> None:
        self.state.rollback(length)


# Process-wide cache of draft weights, keyed weakly by the target model: they depend on the target's
# weights alone, so every LLM, benchmark and notebook drafting for one target shares them, and they
# are freed with it.
_drafts: "weakref.WeakKeyDictionary[Llama, dict]" = weakref.WeakKeyDictionary()


def make_draft(target: Llama, method: str):
    """A fresh proposer for one request. The draft *weights* are built once per target and reused."""
    check_args(method, 1)
    if method == "ngram":
        return NgramDraft()
    built = _drafts.setdefault(target, {})
    if method not in built:
        if method == "draft":
            built[method] = bf16_copy(target)
        else:
            skip = set(default_skipped_layers(target.cfg.n_layers))
            built[method] = layer_subset(target, [i for i in range(target.cfg.n_layers) if i not in skip])
    return ModelDraft(built[method])


def bf16_copy(target: Llama) -> Llama:
    """The separate draft model: every weight of the target stored in bfloat16 (half the bytes),
    fused like the target so it runs on the same fast path."""
    fused = (".wqkv.", ".w_gate_up.")
    state = {name: t.to(torch.bfloat16) for name, t in target.state_dict().items()
             if not any(f in name for f in fused)}
    with torch.device("meta"):
        draft = Llama(target.cfg)
    draft.load_state_dict(state, assign=True)
    if is_fused(target):
        fuse_projections(draft)
    return draft.eval()


# ---- the runner ---------------------------------------------------------------------------------------

@dataclass
class SpecStats:
    """What happened in one request: enough to compute acceptance rate and tokens per target call."""
    k: int = 0
    target_calls: int = 0              # verification forwards (the prefill is not counted)
    drafted: int = 0                   # draft tokens proposed
    accepted: int = 0                  # draft tokens accepted
    rejections: int = 0                # rounds that ended in a rejection (n < k_round)
    emitted: int = 0                   # tokens produced by verification calls (accepted + 1 each)
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    accepted_per_call: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted (vLLM's definition)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def alpha(self) -> float:
        """Per-token acceptance probability, estimated from the positions actually tested:
        each round tests drafts until the first rejection (a truncated geometric variable)."""
        tested = self.accepted + self.rejections
        return self.accepted / tested if tested else 0.0

    @property
    def tokens_per_call(self) -> float:
        return self.emitted / self.target_calls if self.target_calls else 0.0


def check_policy(policy: str) -> None:
    """Validate LLM(speculative_policy=...)."""
    if policy not in POLICIES:
        raise ValueError(f"speculative_policy = {policy!r} is unknown; allowed: {', '.join(map(repr, POLICIES))}")


def estimate_alpha(accepted: int, rejections: int, prior: float = 0.5, weight: float = 2.0) -> float:
    """Acceptance probability of one draft from a record of accepted drafts and rejecting rounds
    (each round tests drafts until its first rejection), with `weight` pseudo-trials at `prior`."""
    return (accepted + weight * prior) / (accepted + rejections + weight)


def check_args(method: str, k: int) -> None:
    """Validate LLM(speculative_method=..., num_speculative_tokens=...)."""
    if method not in METHODS:
        raise ValueError(f"speculative_method = {method!r} is unknown; allowed: {', '.join(map(repr, METHODS))}")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens = {k!r} is invalid; allowed: an integer in 1..{MAX_SPECULATIVE_TOKENS}")


@torch.no_grad()
def speculative_stream(llm, req, method: str, k: int, stats: SpecStats | None = None,
                       draft=None) -> Iterator[str]:
    """Run one request with speculative decoding, yielding new visible text after every token
    (the contract of LLM.stream_request). draft: a proposer from make_draft (built if None)."""
    check_args(method, k)
    draft = draft or make_draft(llm.model, method)
    stats = stats if stats is not None else SpecStats()
    stats.k = k
    params = req.params
    # NEW: adaptive. t(T) = a + b T of a target call over T tokens, fitted to this request's calls; a
    # round drafts only the guesses that pay (plan_draft_lengths with one request).
    cost = StepCostModel() if getattr(llm, "speculative_policy", "always") == "adaptive" else None
    room = min(llm.max_model_len, len(req.prompt_token_ids) + params.max_tokens) + k + 1
    target = Stepper(llm.model, room)
    if isinstance(draft, ModelDraft):
        draft.reset(room)

    # Prefill exactly as the plain runner does; the first token is sampled from the target.
    if params.prompt_logprobs is not None:
        logits = target.step_all(req.prompt_token_ids)                          # (T, V)
        llm.output_processor.set_prompt_logprobs(req, logits)
        logits = logits[-1]
    else:
        logits = target.step(req.prompt_token_ids)                              # (V,)
    yield llm.output_processor.append(req, logits)
    while not req.finished:
        context = req.all_token_ids                # the target's cache holds all but the last
        left = min(params.max_tokens - len(req.output_token_ids), llm.max_model_len - len(context))
        k_round = min(k, left - 1)
        if cost is not None and k_round > 0:
            alpha = estimate_alpha(stats.accepted, stats.rejections)
            per_draft = stats.draft_seconds / stats.drafted if stats.drafted and isinstance(draft, ModelDraft) else 0.0
            k_round = plan_draft_lengths([alpha], [k_round], 1, 1, cost.fit(), per_draft)[0]
        t0 = time.perf_counter()
        guesses, q = draft.propose(context, k_round, params, req.generator)    # NEW: draft
        t1 = time.perf_counter()
        if guesses:
            logits = target.step_all(context[-1:] + guesses)                    # NEW: (n+1, V) at once
        else:
            logits = target.step(context[-1:])[None]                            # (1, V) plain step
        if cost is not None:
            cost.observe(1 + len(guesses), time.perf_counter() - t1)
        tokens, accepted = verify(guesses, q, logits, params, req.generator)    # NEW: accept/reject
        stats.target_seconds += time.perf_counter() - t1
        stats.draft_seconds += t1 - t0
        # NEW: roll back. Both caches keep the context plus the accepted guesses; the token the
        # target just added is fed at the start of the next round.
        kept = len(context) + accepted
        target.rollback(kept)
        draft.rollback(kept)
        _count(stats, len(guesses), accepted)
        for i in range(accepted + 1):
            yield llm.output_processor.append(req, logits[i], tokens[i])   # the verifier's token
            if req.finished:                       # a stop inside the run discards the rest
                return


def verify(guesses: list[int], q: torch.Tensor | None, logits: torch.Tensor, params: SamplingParams,
           generator) -> tuple[list[int], int]:
    """One request's verification. guesses: n draft ids; q (n, V) or None (deterministic draft);
    logits (n+1, V) from the target. Returns the n+1 candidate tokens and how many guesses passed."""
    drafted = torch.tensor([guesses], dtype=torch.long, device=logits.device)  # (1, n)
    if params.greedy:
        tokens, accepted = greedy_verify(drafted, logits[None])
    else:
        p = torch.stack([filtered_probs(row, params) for row in logits])       # (n+1, V)
        if q is None:                                                           # one-hot draft
            q = F.one_hot(drafted[0], p.shape[-1]).to(p.dtype)                  # (n, V)
        tokens, accepted = rejection_sample(drafted, q[None].to(p.dtype), p[None], generator)
    return tokens[0].tolist(), int(accepted[0])


def _count(stats: SpecStats, drafted: int, accepted: int) -> None:
    stats.target_calls += 1
    stats.drafted += drafted
    stats.accepted += accepted
    stats.rejections += int(accepted < drafted)
    stats.emitted += accepted + 1
    stats.accepted_per_call.append(accepted)
