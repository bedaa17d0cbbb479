"""Static batching (minillm/stages/static_batching.py), the baseline of lesson 07: on the real model in
fp32 its greedy tokens are the engine's, for prompts of different lengths right-padded into one
batch, and its counters say what the padding cost."""
import pytest

from minillm import SamplingParams
from minillm.course.calculators import padding_fraction
from minillm.stages.static_batching import generate_static

TEXTS = ["The capital of France is",
         "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
         "Once upon a time, in a small village by the sea, there lived an old fisherman who",
         "Water boils at"]
MAX_TOKENS = [12, 8, 10, 6]


def test_static_batching_greedy_tokens_equal_the_engine(llm):
    prompts = [llm.get_tokenizer().encode(t) for t in TEXTS]
    assert len({len(p) for p in prompts}) == len(prompts)                 # every row padded differently
    static = generate_static(llm.model, prompts, MAX_TOKENS, batch_size=3)   # a batch of 3, then one of 1
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert static["token_ids"] == [o.outputs[0].token_ids for o in outputs]
    # each batch decodes until its longest request is done: 3 rows x 12 steps, then 1 row x 6
    assert (static["useful_tokens"], static["computed_tokens"], static["steps"]) == (36, 3 * 12 + 6, 12 + 6)


def test_padding_fraction_is_what_generate_static_wastes(tiny_model):
    max_tokens = [5, 1, 3, 2, 7]
    out = generate_static(tiny_model, [[3, 4], [5], [6, 7, 8], [9], [10, 11]], max_tokens, batch_size=2)
    assert padding_fraction(max_tokens, 2) == 1 - out["useful_tokens"] / out["computed_tokens"]
    assert padding_fraction([256] + [16] * 15, 16) == 1 - (256 + 15 * 16) / (16 * 256)


def test_padding_fraction_reproduces_lesson_07s_measured_waste():
    import json
    from pathlib import Path

    doc = json.loads((Path(__file__).resolve().parents[2] / "results/batching.json").read_text())
    static = next(r for r in doc["results"] if r.get("system") == "static")
    assert padding_fraction(doc["config"]["output_lengths"], doc["config"]["hf_batch"]) == pytest.approx(
        static["padding_waste"])
