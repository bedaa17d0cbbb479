"""A draft head on the target's own features (EAGLE, Li et al. 2024, arXiv 2401.15077), trained here.

A separate draft model must learn the language from scratch at a fraction of the target's size. EAGLE's
draft starts from what the target already computed: its top-layer feature f_t (the hidden state the LM
head reads, after the final norm) carries most of what the next token needs. The head predicts the NEXT
feature, and the target's own LM head turns a feature into a token:

    f_hat_{t+1} = Block(fc([embed(x_{t+1}) ; f_t]))             (T, dim): one decoder layer, causal over the T inputs
    draft x_{t+2} = argmax( f_hat_{t+1} @ E_d^T )                the target's embedding rows, a draft vocabulary

Drafting k tokens runs the head k times, each on the previous prediction: (f_hat_{t+1}, x_{t+2}) -> f_hat_{t+2} ...
The draft vocabulary is the most frequent tokens of the training text (EAGLE-3, arXiv 2503.01840, drafts
over a reduced vocabulary too): its LM head reads fewer rows, and a token outside it is simply never drafted.

Training (train_head) runs on text the target generates itself, with EAGLE's loss: smooth-L1 between predicted
and real next features plus 0.1 x a classification term, here the KL divergence from the target's own next-token
distribution (its real next feature through the draft vocabulary) rather than the text's token, so that the head
learns the target's choice even where the text was sampled. Its first
pass is teacher-forced (every input the target's real feature); a second pass feeds the head its own
predictions, since from its second token on a draft reads features it predicted (EAGLE-3's "training-time
test", arXiv 2503.01840, in its simplest form).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.engine.sampling import SamplingParams, filtered_probs
from minillm.model.llama import Block, Llama, naive_attention_fp32, sdpa_attention
from minillm.model.positions import rope_cos_sin

CLS_WEIGHT = 0.1          # EAGLE §3.2: L = L_reg + w_cls L_cls, w_cls = 0.1


@dataclass(frozen=True)
class HeadConfig:
    draft_vocab: int = 8192          # the most frequent tokens of the training text
    lr: float = 1e-3
    steps: int = 600
    batch: int = 8                   # sequences per step
    seq_len: int = 256
    unroll: int = 2                  # passes per sequence: teacher-forced, then on the head's own predictions
    noise: float = 0.1               # uniform noise on input features, x their RMS (EAGLE §3.2 adds U(-0.1, 0.1))
    weight_decay: float = 0.01
    held_out: float = 0.1            # share of the sequences kept for the curve's held-out agreement
    seed: int = 0


@torch.no_grad()
def target_features(model: Llama, tokens: torch.Tensor) -> torch.Tensor:
    """tokens (B, T) -> f (B, T, dim): the target's top-layer features after the final norm (what its LM
    head reads: logits = f @ E^T for a tied head), by the baseline forward."""
    T = tokens.shape[1]
    cos, sin = rope_cos_sin(torch.arange(T), model.cfg.head_dim, model.cfg.rope_theta, model.cfg.rope_scaling)
    h = model.embed(tokens)
    for layer in model.layers:
        h = layer(h, cos, sin, naive_attention_fp32)
    return model.norm(h)


class EagleHead(nn.Module):
    """fc over [embedding of the next token ; the current feature], one decoder layer of the target's shape
    (its own weights), and the draft vocabulary's rows of the target's (tied) embedding as the LM head."""

    def __init__(self, target: Llama, vocab: torch.Tensor):
        super().__init__()
        cfg = target.cfg
        if target.lm_head is not None:
            raise ValueError("EagleHead reads the target's tied embedding as its LM head; this target has an untied "
                             "head (lm_head), which the draft would need to copy: not built")
        self.cfg = cfg
        self.fc = nn.Linear(2 * cfg.dim, cfg.dim)
        self.block = Block(cfg)
        self.register_buffer("vocab", vocab.long())                   # (V_d,) draft token ids
        self.embed = target.embed                                     # shared, frozen
        self.embed.weight.requires_grad_(False)
        # the LM head's draft rows, gathered once: a gather per draft would copy V_d x dim floats each time
        # (fp32 whatever the target's dtype: the head runs in fp32 on a bf16 target's features too)
        self.register_buffer("lm_rows", target.embed.weight.detach()[self.vocab].float(), persistent=False)   # (V_d, dim)
        self.draft_lm = None                                          # the same rows in row blocks (use_blocked_linears)

    def forward(self, features: torch.Tensor, next_tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """features (B, T, dim) at positions start .. start+T-1 and the tokens that followed each (B, T) ->
        predicted features (B, T, dim) one position later, causal over the T inputs."""
        return self._layer(features, next_tokens, torch.arange(start, start + features.shape[1]), naive_attention_fp32)

    def _layer(self, features: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """fc([embed(next token) ; feature]) and the decoder layer, the T inputs at positions (T,)."""
        x = self.fc(torch.cat([self.embed(next_tokens).float(), features], dim=-1))     # (B, T, dim)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling)
        return self.block(x, cos, sin, attend)                                  # (B, T, dim)

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        """(..., dim) -> (..., V_d) over the draft vocabulary."""
        return features @ self.lm_rows.t() if self.draft_lm is None else self.draft_lm(features)

    def use_blocked_linears(self) -> bool:
        """NEW: for drafting in the engine on a CPU, every projection and the draft LM head by the few-row GEMM
        kernel over weights in row blocks (model/cpu_gemm.py): a head step is one token, where the library GEMM
        costs several times the weight read. -> whether the kernel took them (not where it cannot be built)."""
        from minillm.model import cpu_gemm

        if not cpu_gemm.takes(self.lm_rows):
            return False
        cpu_gemm.use_blocked_linears(self)
        self.draft_lm = cpu_gemm.BlockedLinearModule(self.lm_rows)
        return True

    def step(self, cache: "HeadCache", features: torch.Tensor, next_tokens: list[int]) -> torch.Tensor:
        """Incremental forward: features (T, dim) at positions cache.end .. cache.end + T - 1 and the token
        after each -> predicted next features (T, dim); their keys and values join the cache."""
        positions = torch.arange(cache.end, cache.end + features.shape[0])
        return self._layer(features[None], torch.tensor([next_tokens]), positions, cache.attend)[0]   # (T, dim)

    def tree_step(self, keys: "TreeKeys", nodes: list[tuple], features: torch.Tensor, next_tokens: list[int],
                  positions: torch.Tensor) -> torch.Tensor:
        """NEW: tree drafts: several nodes at once, features (T, dim) at positions (T,) and each node's token ->
        predicted features (T, dim); each node attends to the cached context, its ancestors and itself (keys), and
        nothing joins the cache."""
        return self._layer(features[None], torch.tensor([next_tokens]), positions, keys.attend(nodes))[0]

    @torch.no_grad()
    def propose(self, features: torch.Tensor, tokens: list[int], k: int) -> list[int]:
        """Greedy drafts: features (L, dim) of the context's positions 0 .. L-1 (the target's), tokens the L + 1
        context tokens (position i's next token is tokens[i + 1]) -> k draft tokens."""
        f = features[None]                                                    # (1, L, dim)
        nxt = torch.tensor(tokens[1:])[None]                                  # (1, L)
        drafts = []
        for _ in range(k):
            pred = self(f, nxt)[:, -1:]                                       # (1, 1, dim): the next feature
            token = int(self.vocab[self.draft_logits(pred)[0, 0].argmax()])
            drafts.append(token)
            f = torch.cat([f, pred], dim=1)
            nxt = torch.cat([nxt, torch.tensor([[token]])], dim=1)
        return drafts


class HeadCache:
    """The head's own KV cache for one sequence: keys and values of positions base .. end - 1, contiguous (the head
    is one layer; a paged pool would buy nothing here). Rolled back by cutting."""

    def __init__(self, base: int = 0):
        self.base, self.k, self.v = base, None, None                     # (1, Hkv, end - base, hd) each

    @property
    def end(self) -> int:
        return self.base + (0 if self.k is None else self.k.shape[2])

    def truncate(self, end: int) -> None:
        """Forget positions >= end."""
        if self.k is not None and end < self.end:
            self.k, self.v = self.k[:, :, :max(0, end - self.base)], self.v[:, :, :max(0, end - self.base)]

    def attend(self, q, k, v, causal: bool = True, window: int | None = None):
        """Block's attention function: the new keys join the cached ones, the queries are the last T."""
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return sdpa_attention(q, self.k, self.v, causal, window)        # fused, GQA without copying K/V


class EagleDraft:
    """One request's EAGLE proposer in the engine. The target's runner hands it the features of every position
    it computes (add_features); propose() feeds the head the ones it has not seen, each with the token that
    followed it, then drafts k tokens on its own predicted features. Those k - 1 predicted positions leave the
    head's cache again: once verified, the target's real features replace them (EAGLE drafts from real features
    wherever it has them)."""

    def __init__(self, head: EagleHead):
        self.head = head
        self.release()

    def add_features(self, start: int, features: torch.Tensor) -> None:
        """features (n, dim): the target's, at positions start .. start + n - 1 (verified tokens only). The real
        features known are the cache's positions base .. end - 1, then `pending` from end on."""
        features = features.float()
        have = self.cache.end + len(self.pending)
        if start < self.cache.base or start > have:   # a gap (a prefix-cache hit never computed): start there
            self.cache, self.pending, self.last_pred = HeadCache(start), features, None
        elif start < self.cache.end:                  # computed again (a preempted request's recompute)
            self.cache.truncate(start)
            self.pending, self.last_pred = features, None
        else:
            self.pending = torch.cat([self.pending[:start - self.cache.end], features])

    def _feed(self, context: list[int]) -> int | None:
        """Feed the head the real features it has not seen, up to the pending token (context[-1], whose feature
        is not computed yet) -> its position `end`, with last_pred (1, dim) the feature predicted there; None
        where the features to draft from are missing (a prefix-cache hit, nothing computed yet)."""
        end = len(context) - 1                                           # features exist for 0 .. end - 1
        fed = self.cache.end
        if end <= self.cache.base or fed + len(self.pending) < end or (fed == end and self.last_pred is None):
            return None
        if fed < end:
            f, self.pending = self.pending[:end - fed], self.pending[end - fed:]      # (T, dim), T >= 1
            self.last_pred = self.head.step(self.cache, f, context[fed + 1:end + 1])[-1:]   # (1, dim) f_hat at end
        return end

    @torch.no_grad()
    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator) -> tuple[list[int], torch.Tensor | None]:
        """k draft tokens after context (whose last token's feature is not computed yet) and q (k, V) they
        were drawn from (None when greedy)."""
        end = self._feed(context) if k > 0 else None
        if end is None:
            return [], None
        pred, tokens, qs = self.last_pred, [], []
        vocab = self.head.vocab
        for i in range(k):
            logits = self.head.draft_logits(pred[0])                     # (V_d,)
            if params.greedy:
                token = int(vocab[logits.argmax()])
            else:
                full = torch.full((self.head.cfg.vocab_size,), float("-inf"))
                full[vocab] = logits
                q = filtered_probs(full, params)                         # (V,) zero outside the draft vocabulary
                token = int(torch.multinomial(q, 1, generator=generator))
                qs.append(q)
            tokens.append(token)
            if i + 1 < k:
                pred = self.head.step(self.cache, pred, [token])         # (1, dim): the next predicted feature
        self.cache.truncate(end)                                         # predicted positions leave the cache
        return tokens, (torch.stack(qs) if qs else None)

    @torch.no_grad()
    def propose_tree(self, context: list[int], paths: tuple) -> tuple[list[int], list[int]]:
        """NEW: tree drafts: the static tree `paths` (tree.tree_paths, topological order) after context: path
        (.., r) is the head's (r+1)-th choice after its parent. -> the nodes' tokens and parents (-1: the pending
        token); ([], []) where there is nothing to draft from. The choices are deterministic whatever the
        temperature: verify_tree's one-hot rule keeps the target's distribution. One head step per depth with
        children, for all its nodes at once: each attends to the context and to its own ancestors."""
        end = self._feed(context)
        if end is None:
            return [], []
        vocab, has_children = self.head.vocab, {p[:-1] for p in paths}
        feature, node = {(): self.last_pred[0]}, {(): -1}       # the feature a node's children are drafted from
        ranked, tokens, parents = {}, [], []
        keys = TreeKeys(self.cache)
        for depth in range(1, len(paths[-1]) + 1):
            level = [p for p in paths if len(p) == depth]
            for p in level:
                parent = p[:-1]
                if parent not in ranked:                         # its children's ranks, best first
                    width = 1 + max(q[-1] for q in level if q[:-1] == parent)
                    ranked[parent] = self.head.draft_logits(feature[parent]).topk(width).indices
                tokens.append(int(vocab[ranked[parent][p[-1]]]))
                parents.append(node[parent])
                node[p] = len(tokens) - 1
            expand = [p for p in level if p in has_children]
            if expand:                                            # input (f_hat at the parent, the node's token)
                f = torch.stack([feature[p[:-1]] for p in expand])                  # (T, dim)
                positions = torch.full((len(expand),), end + depth - 1)
                x = [tokens[node[p]] for p in expand]
                pred = self.head.tree_step(keys, expand, f, x, positions)                  # (T, dim)
                feature.update(zip(expand, pred))
        return tokens, parents

    def release(self) -> None:
        self.cache, self.pending, self.last_pred = HeadCache(), torch.zeros(0, self.head.cfg.dim), None


class TreeKeys:
    """The head's keys and values of a tree's nodes while it drafts the tree: never in its cache (the target's
    real features replace them once verified). A node attends to the cached context, its ancestors and itself."""

    def __init__(self, cache: HeadCache):
        self.cache, self.paths, self.k, self.v = cache, [], None, None          # (1, Hkv, nodes, hd) each

    def attend(self, rows: list[tuple]):
        """The Block's attention function for a head step over the nodes `rows` (paths), which join the keys."""
        def attend(q, k, v, causal=True, window=None):
            ancestors = torch.tensor([[p[:len(a)] == a and len(a) < len(p) for a in self.paths] for p in rows],
                                     dtype=torch.bool).reshape(len(rows), len(self.paths))      # (T, nodes)
            mask = torch.cat([torch.ones(len(rows), self.cache.k.shape[2], dtype=torch.bool), ancestors,
                              torch.eye(len(rows), dtype=torch.bool)], dim=1)                    # (T, S)
            self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
            self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
            self.paths += rows
            keys = torch.cat([self.cache.k, self.k], dim=2)                                      # (1, Hkv, S, hd)
            values = torch.cat([self.cache.v, self.v], dim=2)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return attend


def draft_vocabulary(sequences: list[list[int]], size: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The `size` most frequent tokens of the sequences, and the share of all token occurrences they cover."""
    counts = torch.bincount(torch.tensor([t for s in sequences for t in s]), minlength=vocab_size)
    top = counts.topk(min(size, vocab_size))
    return top.indices.sort().values, float(top.values.sum() / counts.sum())


def train_head(model: Llama, sequences: list[list[int]], config: HeadConfig = HeadConfig(), log=None) -> tuple[EagleHead, list[dict]]:
    """Teacher-forced training on the target's own text -> (the head, the curve: per logged step the loss
    parts and the top-1 agreement of the drafted next token with the target's own choice)."""
    torch.manual_seed(config.seed)
    vocab, coverage = draft_vocabulary(sequences, config.draft_vocab, model.cfg.vocab_size)
    head = EagleHead(model, vocab)
    def chunked(seqs):
        pieces = [s[i:i + config.seq_len + 1] for s in seqs for i in range(0, len(s) - 2, config.seq_len)]
        return [c for c in pieces if len(c) >= 8]

    n_val = int(len(sequences) * config.held_out)
    chunks, val_chunks = chunked(sequences[n_val:]), chunked(sequences[:n_val])
    cache, val_cache = {}, {}
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    warmup = max(1, config.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) *
                                              0.5 * (1 + math.cos(math.pi * min(s, config.steps) / config.steps)))
    gen = torch.Generator().manual_seed(config.seed)
    curve, t0 = [], time.perf_counter()
    for step in range(config.steps):
        picks = torch.randint(0, len(chunks), (config.batch,), generator=gen).tolist()
        reg_sum = cls_sum = hit = count = 0.0
        opt.zero_grad()
        for i in picks:                                                       # one sequence at a time: no padding
            ids = torch.tensor(chunks[i])[None]                               # (1, T + 1)
            if i not in cache:
                cache[i] = target_features(model, ids[:, :-1])                # (1, T, dim) the target's features
            f = cache[i]
            rms = f.pow(2).mean().sqrt()
            noisy = f + (torch.rand(f.shape, generator=gen) * 2 - 1) * config.noise * rms   # exposure to its own errors
            teacher = head.draft_logits(f[0, 1:]).log_softmax(-1)               # (T - 1, V_d): the target's own
            want = teacher.argmax(-1)                                         # next-token choice, what greedy emits
            inputs, loss = noisy[:, :-1], 0.0
            for unroll in range(config.unroll):                               # 0: teacher-forced; then on its own
                pred = head(inputs, ids[:, 1:-1])                             # (1, T - 1, dim): f_1 .. f_{T-1} predicted
                reg = F.smooth_l1_loss(pred, f[:, 1:])
                logits = head.draft_logits(pred[0])                           # (T - 1, V_d)
                cls = F.kl_div(logits.log_softmax(-1), teacher, log_target=True, reduction="batchmean")
                loss = loss + reg + CLS_WEIGHT * cls
                if unroll == 0:
                    reg_sum, cls_sum = reg_sum + reg.item(), cls_sum + cls.item()
                    hit += float((logits.argmax(-1) == want).sum())
                    count += len(want)
                # the next pass reads predicted features, as a draft after its first token does (exposure bias)
                inputs = torch.cat([f[:, :1], pred[:, :-1]], dim=1)
            (loss / len(picks)).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % max(1, config.steps // 30) == 0 or step == config.steps - 1:
            row = {"step": step, "reg_loss": reg_sum / len(picks), "cls_loss": cls_sum / len(picks),
                   "top1_next_token": hit / count, "held_out_top1": _agreement(head, model, val_chunks, val_cache),
                   "seconds": time.perf_counter() - t0}
            curve.append(row)
            if log:
                log(row)
    head.coverage = coverage
    return head.eval(), curve


@torch.no_grad()
def _agreement(head: EagleHead, model: Llama, chunks: list, cache: dict) -> float | None:
    """Teacher-forced top-1 agreement of the drafted next token with the target's own choice there (its argmax,
    what greedy decoding emits), on chunks not trained on."""
    if not chunks:
        return None
    hit = count = 0
    for i, chunk in enumerate(chunks):
        ids = torch.tensor(chunk)[None]
        if i not in cache:
            cache[i] = target_features(model, ids[:, :-1])
        pred = head(cache[i][:, :-1], ids[:, 1:-1])
        hit += int((head.draft_logits(pred[0]).argmax(-1) == head.draft_logits(cache[i][0, 1:]).argmax(-1)).sum())
        count += ids.shape[1] - 2
    return hit / count


def save_head(head: EagleHead, path) -> None:
    torch.save({"state": {k: v for k, v in head.state_dict().items() if not k.startswith("embed.")},
                "config": head.cfg.to_dict()}, path)


def default_head_path():
    """Where bench eagle saves SmolLM2's head, and where the engine looks without speculative_model."""
    from minillm.loading.loader import cache_dir
    return cache_dir() / "eagle-smollm2-135m.pt"


def load_head(target: Llama, path=None) -> EagleHead:
    """A head saved by save_head (path None: default_head_path()), for this target (its shape must match the one
    it was trained on)."""
    path = default_head_path() if path is None else path
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"speculative_method='eagle' needs a trained head; there is none at {path}: train one "
                         f"(python -m minillm bench eagle) or pass speculative_model=PATH") from None
    if saved["config"] != target.cfg.to_dict():
        raise ValueError(f"{path}: this head was trained for another model shape; train one for this target "
                         f"(python -m minillm bench eagle)")
    head = EagleHead(target, saved["state"]["vocab"])
    head.load_state_dict({**saved["state"], "embed.weight": target.embed.weight}, strict=True)
    return head.eval()
