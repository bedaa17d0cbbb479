"""LLM(..., quantization=...) for every method: the batching engine, run on the quantised model,
gives the same greedy tokens as the naive decode (the full forward per token, no cache) of that
same quantised model.

int8, int4, nf4 and fp8 quantise the whole SmolLM2. GPTQ, AWQ and W8A8 (SmoothQuant) calibrate block
by block, which takes minutes for 30 blocks on a CPU, so they run on SmolLM2's first two blocks (real
weights and tokenizer) with one 64-token calibration window."""
import copy

import pytest
import torch.nn as nn

import minillm.quant as quant
from minillm import LLM, SamplingParams
from minillm.quant.linear import QuantLinear
from minillm.speculative.core import layer_subset
from minillm.stages.kv_cache import generate_greedy_naive

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,"]
N_TOKENS = 4


@pytest.fixture
def tiny_calibration(monkeypatch):
    """LLM calibrates GPTQ and AWQ on quant.calibration_windows(tokenizer, n): here one 64-token window.
    -> the window counts LLM asked for, in order."""
    full, asked = quant.calibration_windows, []

    def one_window(tokenizer, n_windows):
        asked.append(n_windows)
        return full(tokenizer, n_windows=1, window=64)

    monkeypatch.setattr(quant, "calibration_windows", one_window)
    return asked


def quantized_llm(llm, method, n_layers=None):
    """An LLM around a copy of the session's SmolLM2 (or of its first n_layers blocks), quantised by LLM."""
    model = llm.model if n_layers is None else layer_subset(llm.model, list(range(n_layers)))
    return LLM(model=copy.deepcopy(model), tokenizer=llm.get_tokenizer(), device="cpu", quantization=method)


def assert_engine_equals_naive_decode(q, fmt):
    linears = [m for m in q.model.layers.modules() if isinstance(m, (nn.Linear, QuantLinear))]
    assert len(linears) == 7 * q.config.n_layers and all(type(m) is QuantLinear and m.fmt == fmt for m in linears)
    prompts = [q.get_tokenizer().encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
    outputs = q.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert q._engine is not None                                   # two requests: the batching engine ran them
    assert [o.outputs[0].token_ids for o in outputs] == [generate_greedy_naive(q.model, p, N_TOKENS) for p in prompts]


@pytest.mark.parametrize("method,fmt", [("int8", "int8"), ("int4", "int"), ("nf4", "nf4"), ("fp8", "fp8")])
def test_data_free_quantized_llm_engine_equals_naive_decode(llm, method, fmt):
    assert_engine_equals_naive_decode(quantized_llm(llm, method), fmt)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibrated_quantized_llm_engine_equals_naive_decode(llm, tiny_calibration, method):
    q = quantized_llm(llm, method, n_layers=2)
    assert tiny_calibration == [{"gptq": 32, "awq": 8}[method]]   # GPTQ over-fits 8 windows (bench calibration)
    if method == "gptq":                                           # act-order by default: codes stored permuted
        assert all("perm" in m.tensor_names for m in q.model.layers.modules() if isinstance(m, QuantLinear))
    else:
        assert len(q.model.awq_alphas) == 2                        # one record per calibrated block
    assert_engine_equals_naive_decode(q, "int")


def test_w8a8_llm_engine_equals_naive_decode(llm, tiny_calibration):
    """W8A8 with SmoothQuant: the engine's stacked int8 GEMMs (compiled in a batched step) against the naive decode of
    the same model, whose layers quantise each token's activations one by one; the LM head is W8A8 too."""
    q = quantized_llm(llm, "w8a8", n_layers=2)
    assert tiny_calibration == [8]
    assert q.model.lm_head.fmt == "w8a8"
    assert_engine_equals_naive_decode(q, "w8a8")
    assert q.engine.runner.compiled_batched_steps > 0
