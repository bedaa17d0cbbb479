"""SamplingParams (vLLM's names and defaults) and the sampler: greedy, temperature, top-k, top-p.

Each request owns a torch.Generator seeded from `seed`, so a seeded request draws the same
tokens whatever else shares its batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class GuidedDecodingParams:
    """Structured output (vLLM's names): exactly one of json (a JSON schema, dict or text), regex,
    choice (a list of strings), grammar (GBNF / EBNF text, start rule `root`) or json_object=True
    (any JSON object). jump_forward (minillm's, off by default) appends the tokens the grammar
    forces without sampling them (minillm/guided)."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    jump_forward: bool = False

    def __post_init__(self):
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"GuidedDecodingParams takes exactly one of json, regex, choice, grammar, "
                             f"json_object=True; got {', '.join(given) or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"GuidedDecodingParams.choice = {self.choice!r} is invalid; allowed: a non-empty list "
                             f"of non-empty strings")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"GuidedDecodingParams.{name} must be a string; got "
                                 f"{type(getattr(self, name)).__name__}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"GuidedDecodingParams.json must be a schema (a dict or its JSON text); "
                             f"got {type(self.json).__name__}")
        if self.json_object not in (None, True, False) or not isinstance(self.jump_forward, bool):
            raise ValueError("GuidedDecodingParams.json_object and jump_forward must be booleans")


@dataclass
class SamplingParams:
    temperature: float = 1.0     # 0 means greedy
    top_p: float = 1.0           # nucleus: keep the smallest set of tokens with mass >= top_p
    top_k: int = -1              # keep the k most likely tokens; -1 keeps all
    max_tokens: int = 16         # new tokens to generate at most
    seed: int | None = None
    stop: str | list[str] | None = None   # stop strings (not included in the output text)
    ignore_eos: bool = False
    logprobs: int | None = None           # per generated token: its logprob + the top-k
    prompt_logprobs: int | None = None    # per prompt position: the actual token's logprob + top-k
    stop_token_ids: list[int] = field(default_factory=list)
    guided_decoding: GuidedDecodingParams | None = None   # structured output: json / regex / choice

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.validate()

    def validate(self) -> None:
        def bad(name, allowed):
            raise ValueError(f"SamplingParams.{name} = {getattr(self, name)!r} is invalid; allowed: {allowed}")

        def number(v):          # bool is an int subclass; NaN and inf pass every comparison test below
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        def integer(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if not number(self.temperature) or self.temperature < 0:
            bad("temperature", "a finite number >= 0 (0 = greedy)")
        if not number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "a number in (0, 1]")
        if not integer(self.top_k) or self.top_k == 0 or self.top_k < -1:
            bad("top_k", "-1 (disabled) or an integer >= 1")
        if not integer(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "an integer >= 1")
        if self.seed is not None and not (integer(self.seed) and -2**63 <= self.seed < 2**64):
            bad("seed", "None or an integer in [-2**63, 2**64) (what torch.Generator takes)")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "a non-empty string or a list of non-empty strings")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not integer(v) or v < 0):
                bad(name, "None or an integer >= 0")
        guided = self.guided_decoding
        if guided is not None:
            if not isinstance(guided, GuidedDecodingParams):
                bad("guided_decoding", "None or a GuidedDecodingParams")
            if self.ignore_eos:
                bad("ignore_eos", "False with guided_decoding (the output must end where the grammar lets it end)")
            if guided.jump_forward and self.logprobs is not None:
                bad("logprobs", "None with guided_decoding.jump_forward (jump-forward tokens are not sampled: "
                                "they have no logits)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A per-request random stream; None for greedy requests (nothing is drawn)."""
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits (V,) -> the probabilities we sample from (V,) after temperature, top-k and top-p."""
    logits = logits.float() / params.temperature
    if params.top_k != -1 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p          # mass of strictly more likely tokens
        drop = mass_before >= params.top_p                    # the most likely token is always kept
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum()
    return probs


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One next token id from logits (V,)."""
    if params.greedy:
        return int(logits.max(-1).indices)                    # the first maximal index, as argmax; faster in bf16
    probs = filtered_probs(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator))
