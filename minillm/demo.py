"""The main demo: SmolLM2-135M-Instruct answers chat prompts, streamed, then tokens/s."""
from __future__ import annotations

import time

from . import LLM, SamplingParams
from .benchmarks.common import machine_info

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Give me three tips for writing readable Python code.",
    "Explain in two sentences why the sky is blue.",
]


def main(model: str = "smollm2", dtype: str = "float32", max_tokens: int = 96) -> None:
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype=dtype)
    print(f"loaded {model} ({dtype}, {llm.device}) in {time.perf_counter() - t0:.1f} s\n")
    t0 = time.perf_counter()   # on CPU the first decode step compiles it (lesson 02, item 6): once per process
    llm.generate(["Hi"], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    print(f"warm-up (compiles the decode step on CPU) in {time.perf_counter() - t0:.1f} s\n")
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
