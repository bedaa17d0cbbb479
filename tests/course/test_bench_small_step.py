"""bench small-step's plumbing on a tiny model: each way runs the path it names (the small step's compiled layer, the
batched step's), on the same batches, with logits equal up to fp32 summation order, and no KV block is left held."""
import pytest

from helpers import CharTokenizer
from minillm import LLM
from minillm.course.benchmarks import small_step
from minillm.model import cpu_gemm
from minillm.model.llama import random_model, tiny_config


@pytest.mark.skipif(cpu_gemm.kernel()[0] is None, reason="no few-row kernel here")
def test_each_way_runs_its_path_on_every_shape():
    llm = LLM(model=random_model(tiny_config(), seed=0), tokenizer=CharTokenizer(), max_model_len=256,
              max_num_seqs=16, tune_kernels=False)
    runner = llm.engine.runner
    small, batched, decode_only = runner.compiled_decode_steps, runner.compiled_batched_steps, runner.compiled_decode_only_steps
    rows = small_step.measure(llm, "float32", rounds=1, repeats=1)
    assert [r["shape"] for r in rows] == ["run of 1", "run of 2", "run of 4", "run of 8", "2 decodes", "4 decodes",
                                          "8 decodes"]
    assert [r["rows"] for r in rows] == [1, 2, 4, 8, 2, 4, 8]
    calls = 1 * (2 + 1 + 1)                                        # per shape and way: warm-up, repeats, logits
    assert runner.compiled_decode_steps - small >= calls * (7 + 1)  # every shape small, "run of 1" both ways
    assert runner.compiled_batched_steps - batched >= calls * 6     # every shape of 2+ rows batched
    if runner.attention.name == "cpu":                              # ... the decodes in one graph per layer
        assert runner.compiled_decode_only_steps - decode_only >= calls * 3
    assert all(r["max_logit_diff"] < 1e-4 for r in rows) and rows[0]["small_vs_one_row"] == 1.0
    assert runner.small_step_rows == small_step.RUNS[-1]           # restored
    bm = llm.engine.block_manager
    assert not llm.engine.requests and bm.num_free_blocks == bm.num_blocks
