"""The engine's one configuration: every knob of LLM(...), grouped the way vLLM v1 groups them,
validated once, when it is built, and handed to every component.

    config = EngineConfig.from_kwargs(max_num_seqs=16, enable_prefix_caching=True)
    config.scheduler.max_num_seqs          # 16
    LLM(model="smollm2", max_num_seqs=16)  # builds the same object: llm.engine_config

    CacheConfig        the paged KV pool: block size, number of blocks, KV dtype, prefix caching
    SchedulerConfig    the step's budgets: sequences, tokens, chunked prefill, max_model_len
    SpeculativeConfig  drafts inside the engine's steps: method, k, policy
    ParallelConfig     tensor / pipeline parallel sizes (worker processes, minillm/parallel)
    RunConfig          how the model runs: dtype, device, quantisation, attention, graphs, tuning

Each dataclass checks its own fields in __post_init__ (a ValueError naming the argument and what
is allowed); EngineConfig checks the rules that join two groups. Nothing that needs the loaded
model is checked here (max_model_len against the model's context, the default number of KV
blocks): the LLM does that once the model is in (check_model, resolve_num_kv_blocks).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from minillm.kvcache.block_manager import check_prefix_cache
from minillm.model.cuda_graphs import check_enforce_eager
from minillm.model.llama import check_attention_backend
from minillm.model.runner import KV_CACHE_DTYPES, PagedKVCache

DEFAULT_KV_CACHE_BYTES = 1 << 30        # 1 GiB of K/V when num_kv_blocks is not given (more blocks with int8)


def _check_int(name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} = {value!r} is invalid; allowed: an integer >= {low}")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} = {value!r}; allowed: True or False")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None            # None: as many as DEFAULT_KV_CACHE_BYTES hold
    kv_cache_dtype: str = "auto"                # "auto" (the model's dtype), "int8", "fp8"
    enable_prefix_caching: bool = False
    prefix_cache: str = "hash"                  # the index: "hash" (vLLM's) or "radix" (SGLang's)

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype = {self.kv_cache_dtype!r} is not supported; allowed: "
                             f"{', '.join(map(repr, KV_CACHE_DTYPES))}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size = {self.block_size!r} is invalid; allowed: an integer >= 1 (16 is usual)")
        _check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_prefix_cache(self.prefix_cache, self.enable_prefix_caching)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_model_len: int = 2048

    def __post_init__(self):
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_model_len", self.max_model_len, 2)
        _check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        # without chunks a preempted request is recomputed as ONE prefill of prompt + output (up to
        # max_model_len tokens): a smaller step budget could never re-admit it and would block the
        # queue. vLLM refuses the same (SchedulerConfig._verify_args)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens = {self.max_num_batched_tokens} is smaller than max_model_len "
                             f"= {self.max_model_len}; allowed with enable_chunked_prefill=False: "
                             f"max_num_batched_tokens >= max_model_len (a sequence must fit one step); or enable "
                             f"chunked prefill")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str | None = None                   # None: no drafts; one of speculative.core.ENGINE_METHODS
    num_speculative_tokens: int = 5
    policy: str = "adaptive"                    # "adaptive": as many drafts as pay at the batch; "always": k
    model: str | None = None                    # "eagle": the head's file (None: eagle.default_head_path())
    token_tree: tuple | None = None             # NEW: "eagle": a static draft tree (speculative.tree.tree_paths)

    def __post_init__(self):
        if self.model is not None and self.method != "eagle":
            raise ValueError(f"speculative_model = {self.model!r} with speculative_method = {self.method!r}: only "
                             f"'eagle' reads a file (its trained head); leave speculative_model out")
        if self.token_tree is not None:
            from minillm.model.runner import SMALL_STEP_ROWS
            from minillm.speculative.tree import tree_paths

            if self.method != "eagle":
                raise ValueError(f"speculative_token_tree with speculative_method = {self.method!r}: only 'eagle' "
                                 f"drafts trees; leave speculative_token_tree out")
            paths = tree_paths(self.token_tree, SMALL_STEP_ROWS - 1)
            if self.num_speculative_tokens != len(paths):
                raise ValueError(f"speculative_token_tree has {len(paths)} nodes but num_speculative_tokens = "
                                 f"{self.num_speculative_tokens}: a tree's drafts per step are its nodes; pass "
                                 f"num_speculative_tokens={len(paths)}")
            object.__setattr__(self, "token_tree", paths)
        if self.method is not None:
            from minillm.speculative.core import ENGINE_METHODS, check_args, check_policy
            check_args(self.method, self.num_speculative_tokens, ENGINE_METHODS)
            check_policy(self.policy)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    expert_parallel_size: int = 1               # a mixture of experts' routed experts over this many processes

    def __post_init__(self):
        sizes = {name: getattr(self, name) for name in ("tensor_parallel_size", "pipeline_parallel_size",
                                                       "expert_parallel_size")}
        for name, value in sizes.items():
            _check_int(name, value, 1)
        above = [f"{name} = {value}" for name, value in sizes.items() if value > 1]
        if len(above) > 1:
            raise ValueError(f"{' with '.join(above)} is not supported; allowed: one of them > 1")

    @property
    def mode(self) -> str | None:
        """"tensor", "pipeline", "expert" or None (one process)."""
        if self.tensor_parallel_size > 1:
            return "tensor"
        if self.expert_parallel_size > 1:
            return "expert"
        return "pipeline" if self.pipeline_parallel_size > 1 else None

    @property
    def size(self) -> int:
        return max(self.tensor_parallel_size, self.pipeline_parallel_size, self.expert_parallel_size)


@dataclass(frozen=True)
class RunConfig:
    dtype: str = "float32"
    device: str = "auto"
    quantization: str | None = None
    attention_backend: str = "sdpa"             # prefill attention: "naive", "sdpa", "flash"
    enforce_eager: bool = False                 # True: no CUDA graphs
    tune_kernels: bool = True                   # False: the build times nothing, recorded defaults

    def __post_init__(self):
        from .quant import METHODS as QUANT_METHODS

        if self.quantization not in (None, *QUANT_METHODS):
            raise ValueError(f"quantization = {self.quantization!r} is not supported; allowed: None, "
                             f"{', '.join(map(repr, QUANT_METHODS))}")
        check_attention_backend(self.attention_backend)
        check_enforce_eager(self.enforce_eager)
        _check_bool("tune_kernels", self.tune_kernels)


GROUPS = {"cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig, "run": RunConfig}
# LLM(...)'s speculative keywords carry vLLM's prefix; the dataclass fields drop it
SPECULATIVE_KEYWORDS = {"speculative_method": "method", "num_speculative_tokens": "num_speculative_tokens",
                        "speculative_policy": "policy", "speculative_model": "model",
                        "speculative_token_tree": "token_tree"}


@dataclass(frozen=True)
class EngineConfig:
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self):
        if self.parallel.mode is not None:
            if self.run.quantization is not None or self.speculative.method is not None:
                raise ValueError("tensor/pipeline parallelism runs the unquantised model on the batching engine; "
                                 "allowed with it: quantization=None and speculative_method=None")
            if self.run.attention_backend != "sdpa":
                raise ValueError(f"attention_backend = {self.run.attention_backend!r} with tensor/pipeline "
                                 f"parallelism is not supported; allowed with it: 'sdpa' (the worker processes "
                                 f"attend with it)")
        per_seq = self.blocks_per_sequence
        blocks = self.cache.num_kv_blocks
        if blocks is not None and (not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < per_seq):
            raise ValueError(f"num_kv_blocks = {blocks!r} is too small; allowed: an integer >= {per_seq} (one "
                             f"sequence of max_model_len={self.scheduler.max_model_len} tokens must fit)")

    @property
    def blocks_per_sequence(self) -> int:
        """KV blocks one sequence of max_model_len tokens needs."""
        return math.ceil(self.scheduler.max_model_len / self.cache.block_size)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """vLLM's flat keyword names (those LLM takes) -> the grouped config; an unknown name is refused."""
        groups = {name: {} for name in (*GROUPS, "speculative")}
        owner = {f.name: group for group, c in GROUPS.items() for f in dataclasses.fields(c)}
        for key, value in kwargs.items():
            if key in SPECULATIVE_KEYWORDS:
                groups["speculative"][SPECULATIVE_KEYWORDS[key]] = value
            elif key in owner:
                groups[owner[key]][key] = value
            else:
                raise ValueError(f"{key!r} is not an engine option; allowed: "
                                 f"{', '.join(sorted([*owner, *SPECULATIVE_KEYWORDS]))}")
        return cls(**{name: GROUPS[name](**values) for name, values in groups.items() if name != "speculative"},
                   speculative=SpeculativeConfig(**groups["speculative"]))

    def replace(self, **kwargs) -> "EngineConfig":
        """A copy with some flat keywords changed (validated again), as benchmarks vary one knob."""
        return EngineConfig.from_kwargs(**{**self.to_kwargs(), **kwargs})

    def to_kwargs(self) -> dict:
        """The flat keywords that build this config again."""
        out = {}
        for name in GROUPS:
            out.update(dataclasses.asdict(getattr(self, name)))
        out.update({flat: getattr(self.speculative, own) for flat, own in SPECULATIVE_KEYWORDS.items()})
        return out


def resolve_num_kv_blocks(config: EngineConfig, model_cfg, dtype) -> int:
    """config.cache.num_kv_blocks, or where it is None as many blocks as DEFAULT_KV_CACHE_BYTES hold
    for this model (at least one full sequence)."""
    if config.cache.num_kv_blocks is not None:
        return config.cache.num_kv_blocks
    per_block = PagedKVCache.bytes_per_block(model_cfg, config.cache.block_size, dtype, config.cache.kv_cache_dtype)
    return max(config.blocks_per_sequence, DEFAULT_KV_CACHE_BYTES // per_block)


def check_model(config: EngineConfig, model_cfg) -> None:
    """The rules that need the loaded model: max_model_len within its context; a sliding-window model
    (Mistral) only where attention applies the window."""
    limit = model_cfg.max_seq_len
    if config.scheduler.max_model_len > limit:
        raise ValueError(f"max_model_len = {config.scheduler.max_model_len} exceeds the model's context of "
                         f"{limit} tokens; allowed: 2..{limit}")
    if config.parallel.expert_parallel_size > 1 and model_cfg.moe is None:
        raise ValueError(f"expert_parallel_size = {config.parallel.expert_parallel_size}: expert parallelism splits a "
                         "mixture of experts, and this model has none; allowed: 1 (or tensor / pipeline parallelism)")
    if model_cfg.mla is not None or model_cfg.moe is not None:
        refused = [f"{name} = {value!r} (allowed: {allowed!r})" for name, value, allowed in (
            ("quantization", config.run.quantization, None), ("kv_cache_dtype", config.cache.kv_cache_dtype, "auto"),
            ("tensor_parallel_size", config.parallel.tensor_parallel_size, 1),
            ("pipeline_parallel_size", config.parallel.pipeline_parallel_size, 1)) if value != allowed]
        if model_cfg.mla is not None and config.run.attention_backend == "flash":
            refused.append("attention_backend = 'flash' (its values must be as wide as its keys; allowed: 'sdpa', 'naive')")
        if config.speculative.method not in (None, "ngram"):
            refused.append(f"speculative_method = {config.speculative.method!r} (allowed: None, 'ngram')")
        if refused:
            raise ValueError(f"an MLA / mixture-of-experts model (DeepSeek, Mixtral) runs in the engine without: "
                             f"{'; '.join(refused)}")
    if model_cfg.sliding_window is not None and config.run.attention_backend == "flash":
        raise ValueError(f"attention_backend = 'flash' has no sliding window, and this model attends to the last "
                         f"{model_cfg.sliding_window} tokens only; allowed here: 'sdpa', 'naive'")
