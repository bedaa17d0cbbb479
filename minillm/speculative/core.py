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

This file holds what the engine's speculation (minillm/speculative/engine.py) and lesson 08's
per-request loop (minillm/stages/speculative_loop.py, a teaching stage) share: the verification rules, the
acceptance and cost model, the planning policy, statistics and argument checks, and the drafts. A
model draft runs its model through the production forward (DraftPool: a runner.ModelRunner over
a paged cache of its own), never through a teaching stage.
"""
from __future__ import annotations

import dataclasses
import weakref
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.engine.sampling import SamplingParams, filtered_probs
from minillm.model.llama import Llama
from minillm.model.positions import RopeTable
from minillm.model.runner import GROUP_COST_BLOCKS, ModelRunner, PagedKVCache, build_batch
from minillm.model.transforms import fuse_projections, is_fused

METHODS = ("draft", "layerskip", "ngram")         # proposers that need nothing but the tokens (the loop runs these)
ENGINE_METHODS = METHODS + ("eagle",)            # and the engine's: EAGLE reads the features its runner returns
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


# ---- the adaptive policy: how many drafts pay (batch 1 here; the engine's batch: speculative/engine.py) ----

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
    gain / (b + c) > E / t (minillm/speculative/engine.py derives it); the gains of one request fall with j,
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

    def release(self) -> None:
        """Nothing to give back."""


class DraftPool:
    """A draft model's forward, the production one: ONE runner.ModelRunner over ONE PagedKVCache
    of its own, shared by every request that drafts with that model (each a ModelDraft holding its own
    blocks). The runner is the engine's: layer.decoder_layer, one-token steps by the compiled decode
    step (compile_steps=True), one attention backend; built with prepack_rows=None and
    tune_kernels=False, so building it times nothing and copies no weight.

    Why one runner shared by requests, not a cache per request: the compiled decode step is guarded on
    the cache's shape, so one cache for all requests compiles its graphs once; a cache per request would
    either change shape with every request's length or, sized from max_model_len, reserve
    max_model_len positions for each request in flight. Blocks are taken from the free list as a
    request's context grows and given back when it ends (ModelDraft.release). Where the free list runs
    out the pool doubles: a new cache (the blocks copied over, block ids unchanged) and a new runner over
    it; Dynamo then treats the block count as symbolic (one recompile), so no later size recompiles."""

    def __init__(self, model: Llama, max_len: int, num_blocks: int | None = None, block_size: int = 16,
                 attention_backend: str = "sdpa"):
        """max_len: the most positions one sequence may hold (RoPE's table). num_blocks: the pool to
        start with (None: one sequence of max_len)."""
        weight = model.embed.weight
        self.model, self.block_size, self.max_len = model, block_size, max_len
        self.attention_backend = attention_backend
        self.rope = RopeTable(model.cfg.head_dim, model.cfg.rope_theta, max_len, weight.device, model.cfg.rope_scaling)
        num_blocks = num_blocks or -(-max_len // block_size)
        self.free = list(range(num_blocks))[::-1]                      # pop() hands out block 0 first
        self.runner = self._runner(PagedKVCache(model.cfg, num_blocks, block_size, weight.dtype, weight.device))
        # runner.group_by_length on CPU; the GPU kernel takes every row at once (as the engine)
        self.group_cost = GROUP_COST_BLOCKS if self.runner.attention.groups_decodes else None

    def _runner(self, kv: PagedKVCache) -> ModelRunner:
        return ModelRunner(self.model, kv, self.rope, prepack_rows=None, tune_kernels=False, compile_steps=True,
                           attention_backend=self.attention_backend)

    @property
    def num_blocks(self) -> int:
        return self.runner.kv.num_blocks

    def take(self, blocks: list[int], positions: int) -> None:
        """Append blocks from the free list to a sequence's table `blocks` until it covers `positions`."""
        need = -(-positions // self.block_size) - len(blocks)
        if need > len(self.free):
            self._grow(need - len(self.free))
        blocks += [self.free.pop() for _ in range(max(0, need))]

    def give_back(self, blocks: list[int]) -> None:
        self.free += blocks[::-1]

    def _grow(self, more: int) -> None:
        """At least `more` new blocks: the pool doubles (or more), the cached blocks copied across."""
        old = self.runner.kv
        n = max(2 * old.num_blocks, old.num_blocks + more)
        kv = PagedKVCache(self.model.cfg, n, self.block_size, old.dtype, old.k.device)
        kv.k[:, :old.num_blocks].copy_(old.k)
        kv.v[:, :old.num_blocks].copy_(old.v)
        self.free = list(range(old.num_blocks, n))[::-1] + self.free
        self.runner = self._runner(kv)

    def forward(self, tokens: list[int], start: int, blocks: list[int]) -> torch.Tensor:
        """tokens continuing a sequence at position `start`, its K/V written by position into `blocks`
        (taken as needed) -> logits of the last token (V,): one batch of one run (build_batch)."""
        end = start + len(tokens)
        if end > self.max_len:
            raise ValueError(f"the draft's cache holds {self.max_len} positions per sequence; this step needs {end}")
        self.take(blocks, end)
        bs = self.block_size
        slots = [blocks[p // bs] * bs + p % bs for p in range(start, end)]
        batch = build_batch([(tokens, start, blocks, slots)], ["last"], bs, self.runner.kv.k.device, self.group_cost,
                            self.runner.window)
        return self.runner.forward(batch)[0]                           # (V,)


class ModelDraft:
    """A draft language model (a separate model or a layer subset) proposing k tokens one by one,
    run by the production forward (DraftPool: a ModelRunner over a paged cache). Its sequence: the
    block table `blocks` and `length` positions cached; rolling back forgets positions (the cache is
    written by position, so the next step overwrites them)."""

    def __init__(self, model: Llama, pool: DraftPool | None = None):
        """pool: a DraftPool of `model` shared with other requests (the engine's); None: reset() builds
        one of its own, exactly one sequence long (a request alone: the teaching loop, tests)."""
        if pool is not None and pool.model is not model:
            raise ValueError("ModelDraft: the pool runs another model")
        self.model, self.pool, self.shared = model, pool, pool is not None
        self.blocks: list[int] = []
        self.length = 0
        self.max_len = 0

    def reset(self, max_len: int) -> None:
        """Start a new sequence of at most max_len positions."""
        self.release()
        if not self.shared:
            self.pool = DraftPool(self.model, max_len)
        elif max_len > self.pool.max_len:
            raise ValueError(f"a sequence of {max_len} positions does not fit the draft pool's {self.pool.max_len}")
        self.max_len = max_len

    def step(self, tokens: list[int]) -> torch.Tensor:
        """Feed tokens; logits (V,) of the last one."""
        if len(tokens) and self.length + len(tokens) > self.max_len:
            raise ValueError(f"the draft holds {self.max_len} positions; this step needs {self.length + len(tokens)}")
        logits = self.pool.forward(tokens, self.length, self.blocks)
        self.length += len(tokens)
        return logits

    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator) -> tuple[list[int], torch.Tensor | None]:
        """k tokens drafted one by one, and q (k, V) they were drawn from (None when greedy)."""
        if k == 0:
            return [], None
        # the last context token is always fed: drafts of a round that was never verified (the request
        # was not scheduled) are forgotten here, and the step has a token to give logits for
        self.rollback(len(context) - 1)
        logits = self.step(context[self.length:])                     # (V,): unseen tail, >= 1 token
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
                logits = self.step([token])
        return tokens, (torch.stack(qs) if qs else None)

    def rollback(self, length: int) -> None:
        """Forget cached positions >= length (rejected guesses); the blocks stay this sequence's."""
        self.length = min(self.length, length)

    def release(self) -> None:
        """The sequence is over: its blocks go back to the pool."""
        if self.pool is not None:
            self.pool.give_back(self.blocks)
        self.blocks, self.length = [], 0


# Draft weights, built once per target and kept while it lives (weak keys): they depend on the target's
# weights alone, so every LLM, benchmark and notebook drafting for one target shares them. A cache of
# derived weights, not a switch: what runs does not depend on whether an entry exists.
_drafts: "weakref.WeakKeyDictionary[Llama, dict]" = weakref.WeakKeyDictionary()


def draft_model(target: Llama, method: str) -> Llama:
    """The draft model of a model-based method ("draft": bf16_copy; "layerskip": layer_subset without
    default_skipped_layers), built once per target and reused."""
    if method not in ("draft", "layerskip"):
        raise ValueError(f"speculative_method = {method!r} has no draft model; allowed: 'draft', 'layerskip'")
    built = _drafts.setdefault(target, {})
    if method not in built:
        if method == "draft":
            built[method] = bf16_copy(target)
        else:
            skip = set(default_skipped_layers(target.cfg.n_layers))
            built[method] = layer_subset(target, [i for i in range(target.cfg.n_layers) if i not in skip])
    return built[method]


def make_draft(target: Llama, method: str, pool: DraftPool | None = None):
    """A fresh proposer for one request. The draft *weights* are built once per target and reused;
    pool: a DraftPool of that draft model to share (model methods only; None: the draft's own)."""
    check_args(method, 1)
    if method == "ngram":
        return NgramDraft()
    return ModelDraft(draft_model(target, method), pool)


def bf16_copy(target: Llama) -> Llama:
    """The separate draft model: every weight of the target stored in bfloat16 (half the bytes),
    fused like the target so it runs the same way."""
    fused = (".wqkv.", ".w_gate_up.")
    state = {name: t.to(torch.bfloat16) for name, t in target.state_dict().items()
             if not any(f in name for f in fused)}
    with torch.device("meta"):
        draft = Llama(target.cfg)
    draft.load_state_dict(state, assign=True)
    if is_fused(target):
        fuse_projections(draft)
    return draft.eval()


# ---- statistics and argument checks -------------------------------------------------------------------

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


def check_args(method: str, k: int, allowed: tuple = METHODS) -> None:
    """Validate LLM(speculative_method=..., num_speculative_tokens=...) (allowed: ENGINE_METHODS there)."""
    if method not in allowed:
        raise ValueError(f"speculative_method = {method!r} is unknown; allowed: {', '.join(map(repr, allowed))}")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens = {k!r} is invalid; allowed: an integer in 1..{MAX_SPECULATIVE_TOKENS}")


# ---- one request's verification: the rules above on its logits -----------------------------------------

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
