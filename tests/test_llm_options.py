"""LLM(...) options that switch on a technique: quantization, speculative decoding."""
import pytest

from minillm import LLM, SamplingParams
from minillm.quant.linear import QuantLinear

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def test_int8_quantized_llm_runs_quantized_layers(smollm2_path, llm):
    q = LLM(model=str(smollm2_path), device="cpu", quantization="int8")
    assert isinstance(q.model.layers[0].attn.wq, QuantLinear)
    out = q.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


@pytest.mark.parametrize("method", ["ngram", "layerskip"])
def test_speculative_llm_greedy_equals_plain(smollm2_path, llm, method):
    spec = LLM(model=str(smollm2_path), device="cpu", speculative_method=method, num_speculative_tokens=4)
    got = spec.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert got == llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("kwargs, match", [
    (dict(quantization="int3"), "quantization = 'int3' is not supported"),
    (dict(speculative_method="medusa"), "speculative_method"),
    (dict(speculative_method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
])
def test_bad_options(smollm2_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(model=str(smollm2_path), device="cpu", **kwargs)


def test_a_module_runs_in_its_own_dtype_and_another_dtype_asked_for_is_refused():
    import torch

    from helpers import CharTokenizer
    from minillm.model.llama import random_model, tiny_config

    bf16 = random_model(tiny_config(), seed=0).to(torch.bfloat16)
    for asked in (None, "auto", "bfloat16"):
        llm = LLM(model=bf16, tokenizer=CharTokenizer(), device="cpu", max_model_len=64, dtype=asked)
        assert llm.engine_config.run.dtype == "bfloat16" and llm.model.embed.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype = 'float32' but the model passed in is bfloat16"):
        LLM(model=bf16, tokenizer=CharTokenizer(), device="cpu", max_model_len=64, dtype="float32")
