"""Static batching (minillm/static_batching.py), the baseline of lesson 07: on the real model in
fp32 its greedy tokens are the engine's, for prompts of different lengths right-padded into one
batch, and its counters say what the padding cost."""
from minillm import SamplingParams
from minillm.static_batching import generate_static

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
