"""bench profile: every op lands in exactly one class, the classes add up to the wall time, and the figure draws."""
import pytest

from helpers import CharTokenizer
from minillm.course.benchmarks import profile


@pytest.mark.parametrize("name, cls", [
    ("aten::mm", "weight matmuls"), ("aten::_weight_int4pack_mm_for_cpu", "weight matmuls"),
    ("quantized::int4mm_packed_weight_cpu", "weight matmuls"), ("mkl::_mkl_linear", "weight matmuls"),
    ("mkldnn::_linear_pointwise", "weight matmuls"), ("minillm::prepacked_linear", "weight matmuls"),
    ("minillm::blocked_gemm", "weight matmuls"),
    ("minillm::cpu_decode_attention", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"), ("aten::bmm", "attention"),
    ("## Call CompiledFxGraph fmmkizse5bcmrqv", "compiled code"), ("Torch-Compiled Region: 1/1", "compiled code"),
    ("aten::copy_", "copies, gathers"), ("aten::index_select", "copies, gathers"),
    ("aten::argmax", "other ops"), ("aten::silu", "other ops"),
    ("TorchDynamo Cache Lookup", "outside ops"), ("scheduler.step", "outside ops"),
])
def test_each_op_name_has_one_class(name, cls):
    assert profile.op_class(name) == cls


def test_shares_add_up_to_the_wall_time_and_the_figure_draws(tmp_path):
    from minillm.llm import LLM
    from minillm.model.llama import random_model, tiny_config
    from minillm.engine.sampling import SamplingParams

    llm = LLM(model=random_model(tiny_config(), seed=0), tokenizer=CharTokenizer(), device="cpu", max_model_len=64)
    row = profile.profile_generate(llm, [{"prompt_token_ids": [5, 6, 7]}] * 2,
                                   SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert row["tokens"] == 8
    assert sum(row[f"{c} %"] for c in profile.CLASSES) == pytest.approx(100, abs=0.5)
    assert row["weight matmuls ms"] > 0 and all(row[f"{c} ms"] >= 0 for c in profile.CLASSES)
    profile.plot([dict(row, config="tiny")], tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_read_at_bandwidth_swaps_only_the_weight_matmul_time():
    rows = [{"batch": 1, "model": "bfloat16", "ms_per_token": 9.0, "weight matmuls ms": 0.3},
            {"batch": 1, "model": "int4-bf16", "ms_per_token": 7.0, "weight matmuls ms": 4.0},
            {"batch": 16, "model": "int4-bf16", "ms_per_token": 1.0, "weight matmuls ms": 0.5}]
    # 80 MB at 40 GB/s = 2 ms instead of the profiled 4: 7 - 4 + 2 = 5 ms a token
    got = profile.read_at_bandwidth(rows, {"int4-bf16": 80_000_000}, bandwidth=40e9)
    assert set(got) == {"int4-bf16"}                                        # quantised batch-1 rows only
    limit = got["int4-bf16"]
    assert limit["read_at_bandwidth_ms"] == pytest.approx(2.0)
    assert limit["ms_per_token_if_read_at_bandwidth"] == pytest.approx(5.0)
    assert limit["weight_matmuls_GBps"] == pytest.approx(20.0)
    assert limit["vs_bf16"] == pytest.approx(9 / 7)
    assert limit["vs_bf16_if_read_at_bandwidth"] == pytest.approx(9 / 5)
