"""bench engine-step: the roofline of a batched decode step and the token comparison with transformers."""
import pytest
import torch

from minillm.course.benchmarks import engine_step
from minillm.model.llama import tiny_config


def test_step_roofline_is_the_slower_of_reading_the_weights_and_the_gemm():
    cfg = tiny_config()
    params = cfg.num_parameters()
    # 4 bytes per fp32 weight at 1e9 B/s; 2 FLOPs per weight and row at 1e12 FLOP/s
    read_bound = engine_step.step_roofline(cfg, torch.float32, 2, bandwidth=1e9, gemm_rate=1e12)
    assert read_bound["read_ms"] == pytest.approx(4 * params / 1e6)
    assert read_bound["gemm_ms"] == pytest.approx(2 * params * 2 / 1e9)
    assert read_bound["bound_tok_s"] == pytest.approx(2 / (4 * params / 1e9))
    gemm_bound = engine_step.step_roofline(cfg, torch.bfloat16, 1000, bandwidth=1e12, gemm_rate=1e9)
    assert gemm_bound["bound_tok_s"] == pytest.approx(1000 / (2 * params * 1000 / 1e9))


def test_tokens_are_compared_only_up_to_the_first_end_of_sequence():
    assert engine_step.before_eos([5, 6, 2, 7], eos=2) == [5, 6]
    assert engine_step.before_eos([5, 6, 7], eos=2) == [5, 6, 7]


def _tiny_engine_llm(prepack: bool):
    from helpers import CharTokenizer
    from minillm import LLM
    from minillm.model.llama import random_model

    llm = LLM(model=random_model(tiny_config(), seed=0), tokenizer=CharTokenizer(), device="cpu", max_num_seqs=4,
              max_model_len=256)
    if not prepack:
        llm.engine.runner.drop_prepacked()
    return llm


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="prepacked weights need oneDNN")
def test_gemm_floor_runs_every_prepacked_linear_and_the_head_once_per_call(monkeypatch):
    llm = _tiny_engine_llm(prepack=True)
    runner = llm.engine.runner
    calls = []
    from minillm.model import prepacked
    original = prepacked.PrepackedLinear.__call__
    monkeypatch.setattr(prepacked.PrepackedLinear, "__call__",
                        lambda self, x: calls.append((id(self), tuple(x.shape))) or original(self, x))
    ms = engine_step.gemm_floor_ms(runner, batch=3, repeats=2)
    assert ms > 0
    per_call = 4 * tiny_config().n_layers + 1
    assert len(calls) == 3 * per_call                                     # one warm-up + 2 timed passes
    assert {c[0] for c in calls} == {id(p) for layer in runner.packed_layers for p in layer} | {id(runner.packed_head)}
    assert all(shape[0] == 3 for _, shape in calls)
    llm.close()


def test_gemm_floor_needs_prepacked_weights():
    llm = _tiny_engine_llm(prepack=False)
    with pytest.raises(ValueError, match="prepacked"):
        engine_step.gemm_floor_ms(llm.engine.runner, batch=2)
    llm.close()


def test_decode_step_time_is_the_median_of_decode_only_steps():
    log = [{"seconds": 0.5, "num_decodes": 0, "num_seqs": 4, "num_tokens": 64},    # a prefill
           {"seconds": 0.02, "num_decodes": 4, "num_seqs": 4, "num_tokens": 4},
           {"seconds": 0.04, "num_decodes": 3, "num_seqs": 4, "num_tokens": 20},   # a prefill joined
           {"seconds": 0.03, "num_decodes": 4, "num_seqs": 4, "num_tokens": 4},
           {"seconds": 0.01, "num_decodes": 2, "num_seqs": 2, "num_tokens": 2}]
    assert engine_step.decode_step_ms(log) == pytest.approx(20.0)
    with pytest.raises(ValueError, match="decode-only"):
        engine_step.decode_step_ms(log[:1])


def test_attention_times_cover_the_laid_out_and_the_paged_paths():
    times = engine_step.attention_times(batch=3, keys=20, cfg=tiny_config(), block_size=8)
    assert set(times) == {"bf16_kernel_us", "engine_fp32_kernel_us", "paged_gather_sdpa_us", "paged_fused_us"}
    assert all(t > 0 for t in times.values())
