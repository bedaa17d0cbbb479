"""The main demo: SmolLM2-135M-Instruct answers chat prompts, streamed, then tokens/s.

dtype "auto" (the default) times a short greedy decode in fp32 and in bf16 on this machine and
chats in the faster one. Which wins depends on the CPU and its libraries (on the AMD EPYC VM of an
earlier session bf16 decoded slower than fp32; on the Intel Xeon VM it is faster), so it is measured."""
from __future__ import annotations

import time

from minillm import LLM, SamplingParams
from minillm.course.benchmarks.common import machine_info

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Give me three tips for writing readable Python code.",
    "Explain in two sentences why the sky is blue.",
]


AUTO_DTYPES = ("float32", "bfloat16")
PROBE_TOKENS = 32


def load_warm(model: str, dtype: str) -> LLM:
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype=dtype)
    print(f"loaded {model} ({dtype}, {llm.device}) in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()   # on CPU the first decode step compiles it (lesson 02, item 6): once per process
    llm.generate(["Hi"], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    print(f"warm-up (compiles the decode step on CPU) in {time.perf_counter() - t0:.1f} s")
    return llm


def decode_tok_s(llm: LLM) -> float:
    """Greedy batch-1 tokens/s over PROBE_TOKENS new tokens (the median of 3 runs)."""
    params = SamplingParams(temperature=0.0, max_tokens=PROBE_TOKENS, ignore_eos=True)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        llm.generate(["Tell me about the sea."], params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    return PROBE_TOKENS / sorted(times)[1]


def faster_dtype(model: str) -> tuple[str, LLM]:
    """Load and time every dtype of AUTO_DTYPES; keep the faster model."""
    speeds, llms = {}, {}
    for dtype in AUTO_DTYPES:
        llms[dtype] = load_warm(model, dtype)
        speeds[dtype] = decode_tok_s(llms[dtype])
    best = max(speeds, key=speeds.get)
    print("timed a short decode: " + ", ".join(f"{d} {v:.1f} tok/s" for d, v in speeds.items())
          + f"; chatting in {best}")
    return best, llms[best]


def main(model: str = "smollm2", dtype: str = "auto", max_tokens: int = 96) -> None:
    if dtype == "auto":
        dtype, llm = faster_dtype(model)
    else:
        llm = load_warm(model, dtype)
    print()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tokenizer = llm.get_tokenizer()
    total_tokens, total_time = 0, 0.0
    for question in QUESTIONS:
        print(f"user> {question}\nassistant> ", end="", flush=True)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}])
        (request,) = llm.make_requests([prompt], params)
        t0 = time.perf_counter()
        for piece in llm.stream_request(request):
            print(piece, end="", flush=True)
        total_time += time.perf_counter() - t0
        total_tokens += len(request.output_token_ids)
        print("\n")
    cpu = machine_info()
    print(f"{total_tokens} tokens in {total_time:.1f} s: {total_tokens / total_time:.1f} tokens/s "
          f"(batch 1, greedy, {dtype}, {cpu['gpu'] or cpu['cpu']}, {cpu['threads']} threads)")
