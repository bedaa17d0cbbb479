"""LLM: vLLM's offline interface over minillm's model.

    llm = LLM(model="smollm2")
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    outs[0].outputs[0].text

This file is the front end: it validates and tokenises, then hands every request to the one
engine (minillm/engine/engine.py), one prompt or many, generate, stream or chat alike. The engine
schedules, runs the model and, through the output processor, samples and detokenises.
"""
from __future__ import annotations

import itertools
import time
import weakref
from typing import Iterator

import torch

from minillm.engine.engine import Engine
from minillm.engine.output_processor import OutputProcessor
from minillm.engine.outputs import RequestMetrics, RequestOutput
from minillm.engine.request import Request
from minillm.engine.sampling import SamplingParams, make_generator
from minillm.loading.loader import load_model, resolve_device
from minillm.model.positions import RopeTable
from minillm.model.transforms import fuse_projections
from minillm.quant.linear import QuantLinear
from minillm.speculative.engine import EngineSpeculation
from .config import EngineConfig, check_model

# Process-wide, not per LLM: request ids stay unique when requests made by one LLM meet another's in
# an engine or a log (tests, notebooks and benchmarks build several LLMs around one model).
_request_counter = itertools.count()


def module_dtype(model, dtype: str | None) -> str:
    """The dtype a passed-in module runs in: its own; `dtype`, if given, must name the same."""
    own = str(model.embed.weight.dtype).removeprefix("torch.")
    if dtype not in (None, "auto") and dtype != own:
        raise ValueError(f"dtype = {dtype!r} but the model passed in is {own}: leave dtype out (a module runs in "
                         f"its own dtype) or convert the module first (model.to(torch.{dtype}))")
    return own


class LLM:
    def __init__(self, model: str = "smollm2", dtype: str | None = None, device: str = "auto",
                 max_model_len: int = 2048, attention_backend: str = "sdpa",
                 quantization: str | None = None, speculative_method: str | None = None,
                 num_speculative_tokens: int = 5, block_size: int = 16, num_kv_blocks: int | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 enable_chunked_prefill: bool = True, enable_prefix_caching: bool = False,
                 kv_cache_dtype: str = "auto", prefix_cache: str = "hash", tokenizer=None,
                 tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, expert_parallel_size: int = 1,
                 speculative_policy: str = "adaptive", speculative_model: str | None = None,
                 speculative_token_tree=None, enforce_eager: bool = False, tune_kernels: bool = True):
        """Every keyword but model and tokenizer goes into one EngineConfig (minillm/config.py),
        validated there before the model loads: llm.engine_config.
        model: "smollm2", a .gguf path or an HF folder; or an already-built minillm Llama
        module together with its `tokenizer` (tests use a tiny random model this way).
        dtype: None (the default) is "float32" for a checkpoint loaded here and the module's own
        dtype for a module ("auto" too); a module of another dtype than the one asked for is refused.
        prefix_cache: the index enable_prefix_caching uses, "hash" (vLLM's block hashes) or
        "radix" (SGLang's radix tree); "radix" without enable_prefix_caching is refused.
        tensor_parallel_size / pipeline_parallel_size > 1: the model is split over that many
        processes (minillm/parallel, lesson 11), started here and stopped by close();
        expert_parallel_size > 1: a mixture of experts' routed experts are (lesson 13).
        speculative_method: drafts are proposed and verified inside the engine's steps, for one request or many;
        speculative_policy "adaptive" gives each request as many drafts as pay at the step's batch
        size (minillm/speculative/engine.py), "always" num_speculative_tokens every step.
        speculative_model: with speculative_method="eagle", the trained head's file (default: the one
        `python -m minillm bench eagle` saves for SmolLM2; speculative/eagle.py).
        speculative_token_tree: with "eagle", drafts as a static tree verified in one step (vLLM's option of
        that name: paths of child ranks, e.g. [(0,), (1,), (0, 0)]; speculative/tree.py); then
        num_speculative_tokens must be its node count.
        enforce_eager: False (vLLM's default) replays a CUDA graph for every decode-only step on a GPU
        (minillm/model/cuda_graphs.py); True runs every step op by op.
        tune_kernels: building the engine times the CPU GEMM libraries per weight shape once
        (minillm/model/prepacked.py; recorded in llm.engine.runner.gemm_libraries); False takes the
        recorded default (MKL for fp32: F.linear's bits) and times nothing."""
        from minillm.model.llama import Llama

        dtype = module_dtype(model, dtype) if isinstance(model, Llama) else dtype or "float32"
        self.engine_config = EngineConfig.from_kwargs(
            dtype=dtype, device=device, max_model_len=max_model_len, attention_backend=attention_backend,
            quantization=quantization, speculative_method=speculative_method,
            num_speculative_tokens=num_speculative_tokens, block_size=block_size, num_kv_blocks=num_kv_blocks,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill, enable_prefix_caching=enable_prefix_caching,
            kv_cache_dtype=kv_cache_dtype, prefix_cache=prefix_cache, tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size, expert_parallel_size=expert_parallel_size,
            speculative_policy=speculative_policy, speculative_model=speculative_model,
            speculative_token_tree=speculative_token_tree, enforce_eager=enforce_eager, tune_kernels=tune_kernels)
        self.parallel = None
        self.device = resolve_device(device)
        if isinstance(model, Llama):
            if tokenizer is None:
                raise ValueError("a Llama module as model needs its tokenizer: LLM(model=net, tokenizer=tok)")
            self.model, self.tokenizer = model.to(self.device).eval(), tokenizer
        else:
            self.model, self.tokenizer = load_model(model, dtype=dtype, device=self.device)
        check_model(self.engine_config, self.config)
        self.output_processor = OutputProcessor(self.tokenizer, max_model_len)
        if quantization is not None:
            self._quantize(quantization)
        elif not any(isinstance(m, QuantLinear) for m in self.model.modules()):   # a model quantised already
            fuse_projections(self.model)      # views: the baseline modules see the same weights
        self.rope = RopeTable(self.config.head_dim, self.config.rope_theta, max_model_len, self.device,
                              self.config.rope_scaling)
        self._engine = None                  # built on first use: it allocates the KV pool
        parallel = self.engine_config.parallel
        if parallel.mode is not None:        # last, so that no check above can fail with workers running
            from minillm.parallel.workers import start
            source = None if isinstance(model, Llama) else str(model)      # how the workers get the weights
            self.parallel, self.model = start(self.model, source, parallel.mode, parallel.size, dtype, self.device)
            weakref.finalize(self, self.parallel.close)
            fuse_projections(self.model)     # rank 0's shard or stage: views again, as above

    @property
    def max_model_len(self) -> int:
        return self.engine_config.scheduler.max_model_len

    @property
    def speculative_method(self) -> str | None:
        return self.engine_config.speculative.method

    @property
    def attention_backend(self) -> str:
        return self.engine_config.run.attention_backend

    @property
    def engine(self) -> Engine:
        """The continuous batching engine (lesson 07) that generate() runs on, over a paged KV cache.
        Built again if the model was swapped (e.g. for a converted or quantised one)."""
        if self._engine is None or self._engine.runner.model is not self.model:
            spec = self.engine_config.speculative
            speculation = None if spec.method is None else EngineSpeculation(self, spec)
            self._engine = Engine(self, self.engine_config, speculation=speculation)
        return self._engine

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes (vLLM's method of the same name), so that the next requests compute their
        prompts again, as a benchmark's repeated rounds must. -> False while requests are running (nothing
        is reset), True otherwise."""
        return self._engine is None or self._engine.block_manager.reset_prefix_cache()

    def close(self) -> None:
        """Stop the tensor/pipeline/expert-parallel worker processes (nothing to do for one process)."""
        if self.parallel is not None:
            self.parallel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _quantize(self, method: str) -> None:
        """Quantisation of every linear layer (lesson 04: weight-only, or W8A8); GPTQ, AWQ and W8A8 calibrate on
        evaluate.calibration_text(), which the perplexity evaluation never sees. On a CPU the LM head
        gets an int8 copy too (quant.quantize_lm_head): torch's int8 kernel reads it at batch 1, where
        the full-precision head would be the largest read of every decode step (a W8A8 model's head is W8A8:
        at a batch's rows the weight-only kernel is slower than the int8 GEMM)."""
        from .quant import LLM_CALIBRATION_WINDOWS, calibration_windows, quantize_model

        n_windows = LLM_CALIBRATION_WINDOWS.get(method)
        ids = calibration_windows(self.tokenizer, n_windows) if n_windows else None
        head = ("w8a8" if method == "w8a8" else "int8") if self.device.type == "cpu" else None
        quantize_model(self.model, method, calibration_ids=ids, lm_head=head)

    @property
    def config(self):
        """The running model's config (follows llm.model if it is swapped, e.g. for a converted model)."""
        return self.model.cfg

    def get_tokenizer(self):
        return self.tokenizer

    # ---- requests -------------------------------------------------------------------------

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
            vocab = self.config.vocab_size
            if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise ValueError(f"prompt_token_ids must be integers in [0, {vocab})")
        elif isinstance(prompt, dict) and "prompt" in prompt:
            text, ids = prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        else:
            raise ValueError(f"a prompt must be a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}; "
                             f"got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty (0 tokens); give at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}: "
                             f"the prompt must be shorter than max_model_len to leave room for output")
        return text, ids

    def make_requests(self, prompts, sampling_params=None) -> list[Request]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts is empty; give at least one prompt")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        sampling_params = list(sampling_params)
        if len(sampling_params) != len(prompts) or not all(isinstance(p, SamplingParams) for p in sampling_params):
            raise ValueError(f"sampling_params must be one SamplingParams or a list of {len(prompts)} "
                             f"(one per prompt)")
        requests = []
        for prompt, params in zip(prompts, sampling_params):
            params.validate()
            text, ids = self._prompt_ids(prompt)
            requests.append(Request(
                request_id=str(next(_request_counter)), prompt=text, prompt_token_ids=ids, params=params,
                generator=make_generator(params, self.device), metrics=RequestMetrics(time.time()),
                output_logprobs=[] if params.logprobs is not None else None, guide=self.make_guide(params)))
        return requests

    def make_guide(self, params: SamplingParams):
        """The request's structured-output state (minillm/guided), or None for free text. The
        constraint is compiled here (cached per tokenizer), so a bad schema or regex is a
        ValueError before any token is generated."""
        guided = params.guided_decoding
        if guided is None:
            return None
        from minillm.guided.guide import GuideState, check_jump_forward, compile_guide

        if guided.jump_forward:
            check_jump_forward(self.tokenizer)
        return GuideState(compile_guide(guided, self.tokenizer, self.config.vocab_size), guided.jump_forward)

    # ---- public API -------------------------------------------------------------------------

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion through the continuous batching engine (one prompt is a
        batch of one; with speculative_method set, drafts are verified inside the engine's steps)."""
        requests = self.make_requests(prompts, sampling_params)
        from tqdm.auto import tqdm

        with tqdm(total=len(requests), desc="generate", disable=not use_tqdm) as bar:
            self.engine.run(requests, progress=bar)
        return [self.output_processor.to_output(r) for r in requests]

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one request piece by piece as tokens are generated."""
        (req,) = self.make_requests([prompt], sampling_params)
        for delta in self.stream_request(req):
            if delta:
                yield delta

    @torch.no_grad()
    def stream_request(self, req: Request) -> Iterator[str]:
        """Run one request from make_requests through the engine, yielding its new visible text after
        every step that gave it tokens (possibly ""); stopping early aborts it and frees its blocks."""
        engine = self.engine
        engine.add_request(req)
        try:
            while not req.finished:
                for r, delta in engine.step():
                    if r is req:
                        yield delta
        finally:                                   # the consumer stopped early: free the blocks
            engine.abort_request(req.request_id)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """messages: one conversation (list of {'role', 'content'}) or a list of conversations."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
