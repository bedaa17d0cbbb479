"""minillm/stages/kv_allocation.py: the allocation simulation behind lesson 06's utilisation figures."""
import pytest

from minillm.stages.kv_allocation import (ContiguousPolicy, FirstFit, PagedPolicy, TraceRequest, make_workload,
                                          simulate)


def test_first_fit_takes_the_first_hole_and_merges_on_free():
    memory = FirstFit(100)
    a, b, c = memory.allocate(30), memory.allocate(30), memory.allocate(30)
    assert (a, b, c) == (0, 30, 60)
    memory.free(a, 30)
    memory.free(c, 30)
    assert not memory.can_allocate(50)                   # 70 slots free, but in two pieces: fragmentation
    memory.free(b, 30)
    assert memory.holes == [(0, 100)] and memory.can_allocate(100)
    with pytest.raises(RuntimeError, match="no contiguous hole"):
        FirstFit(10).allocate(11)


def test_workload_fits_the_model_length_and_is_seeded():
    trace = make_workload(500, 2048, seed=3)
    assert all(4 <= r.prompt_len <= 1024 and r.output_len >= 2 and r.prompt_len + r.output_len <= 2048 for r in trace)
    assert [(r.prompt_len, r.output_len) for r in trace] == [(r.prompt_len, r.output_len) for r in make_workload(500, 2048, seed=3)]


def test_every_policy_serves_every_token_and_paging_uses_memory_best():
    trace = make_workload(300, 2048)
    budget = 16384
    results = {name: simulate(policy, trace) for name, policy in {
        "max": ContiguousPolicy("max", budget, 2048), "pow2": ContiguousPolicy("pow2", budget, 2048),
        "oracle": ContiguousPolicy("oracle", budget, 2048), "paged": PagedPolicy(budget, 16)}.items()}
    for sim in results.values():
        assert 0 < sim["kv_utilization"] <= 1
        assert sim["decode_steps"] >= max(r.output_len for r in trace)
    util = {name: sim["kv_utilization"] for name, sim in results.items()}
    assert util["max"] < util["pow2"] < util["oracle"] < util["paged"]
    assert results["max"]["max_running"] <= budget // 2048


def test_paged_policy_preempts_under_pressure_and_frees_every_block():
    """A budget barely above the largest request forces recompute preemptions; the run still drains and
    every block returns to the pool."""
    trace = [TraceRequest(i, 60, 40) for i in range(6)]
    policy = PagedPolicy(budget=192, block_size=16, watermark=0.0)
    sim = simulate(policy, trace)
    assert policy.preemptions > 0 and policy.recomputed_tokens > 0
    assert policy.bm.num_free_blocks == policy.bm.num_blocks
    assert sim["decode_steps"] >= 40


def test_a_request_larger_than_the_budget_is_refused_not_hung():
    with pytest.raises(RuntimeError, match="does not fit"):
        simulate(ContiguousPolicy("oracle", 64, 2048), [TraceRequest(0, 60, 40)])
