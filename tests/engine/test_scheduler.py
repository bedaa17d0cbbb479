"""The scheduler alone: plain Python, no model. Tokens 'sampled' here are fake (always 7)."""
import pytest

from minillm.course.calculators import chunked_prefill_steps
from minillm.engine.outputs import RequestMetrics
from minillm.engine.request import Request, RequestStatus
from minillm.engine.sampling import SamplingParams
from minillm.engine.scheduler import Scheduler
from minillm.kvcache.block_manager import BlockManager


def make_request(rid, prompt_len, max_tokens=4, first_token=100):
    return Request(str(rid), None, list(range(first_token, first_token + prompt_len)),
                   SamplingParams(temperature=0, max_tokens=max_tokens), None, RequestMetrics(0.0))


def finish_step(sched, plan):
    """What the engine does after the forward: sample a fake token, finish at max_tokens."""
    for req in sched.update(plan):
        req.output_token_ids.append(7)
        if len(req.output_token_ids) >= req.params.max_tokens:
            req.finish_reason = "length"
            sched.finish(req)


def run_to_end(sched, max_steps=1000):
    plans = []
    while sched.has_unfinished():
        plan = sched.schedule()
        assert plan.requests, "nothing scheduled although requests wait"
        plans.append([(r.request_id, n) for r, n in zip(plan.requests, plan.num_new_tokens)])
        finish_step(sched, plan)
        assert len(plans) < max_steps
    return plans


def test_token_budget_is_shared_by_decodes_and_prefill_chunks():
    sched = Scheduler(BlockManager(64, 16), max_num_batched_tokens=128)
    for i in range(3):
        sched.add(make_request(i, 100))
    plan = sched.schedule()
    assert [(r.request_id, n) for r, n in zip(plan.requests, plan.num_new_tokens)] == [("0", 100), ("1", 28)]
    finish_step(sched, plan)
    plan = sched.schedule()
    # request 0 now decodes one token; request 1 continues its prefill; request 2 gets the rest
    assert [(r.request_id, n) for r, n in zip(plan.requests, plan.num_new_tokens)] == [("0", 1), ("1", 72), ("2", 55)]
    assert plan.num_batched_tokens == 128


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole():
    sched = Scheduler(BlockManager(64, 16), max_num_batched_tokens=128, enable_chunked_prefill=False)
    for i in range(2):
        sched.add(make_request(i, 100))
    plan = sched.schedule()
    assert [(r.request_id, n) for r, n in zip(plan.requests, plan.num_new_tokens)] == [("0", 100)]
    finish_step(sched, plan)
    plan = sched.schedule()
    assert [(r.request_id, n) for r, n in zip(plan.requests, plan.num_new_tokens)] == [("0", 1), ("1", 100)]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sched.add(make_request(9, 200))


def test_max_num_seqs_and_join_as_soon_as_a_request_leaves():
    sched = Scheduler(BlockManager(64, 16), max_num_seqs=2)
    sched.add(make_request(0, 5, max_tokens=1))
    sched.add(make_request(1, 5, max_tokens=3))
    sched.add(make_request(2, 5, max_tokens=3))
    plans = run_to_end(sched)
    assert plans[0] == [("0", 5), ("1", 5)]          # 2 running at most
    assert plans[1] == [("1", 1), ("2", 5)]          # 0 finished at step 1: 2 joins at once


def test_every_request_completes_and_no_block_leaks():
    bm = BlockManager(40, 4)
    sched = Scheduler(bm, max_num_batched_tokens=16)
    reqs = [make_request(i, 3 + 5 * i, max_tokens=2 + i) for i in range(6)]
    for r in reqs:
        sched.add(r)
    run_to_end(sched)
    assert all(len(r.output_token_ids) == r.params.max_tokens for r in reqs)
    assert bm.num_free_blocks == 40 and bm.request_ids == []


def test_preemption_frees_the_newest_and_it_resumes_first():
    bm = BlockManager(6, 4)                               # 24 token slots
    sched = Scheduler(bm, max_num_batched_tokens=64)
    a, b, c = make_request("a", 8, max_tokens=12), make_request("b", 8, max_tokens=12), make_request("c", 4)
    for r in (a, b):
        sched.add(r)
    plan = sched.schedule()                              # a and b take 4 blocks
    finish_step(sched, plan)
    sched.add(c)
    preempted = []
    while sched.has_unfinished():
        plan = sched.schedule()
        preempted += [r.request_id for r in plan.preempted]
        for r in plan.preempted:
            assert r.num_computed_tokens == 0 and r.status is RequestStatus.WAITING
        if plan.preempted:
            assert sched.waiting[0] is plan.preempted[-1]   # the preempted request is first in line
        finish_step(sched, plan)
    assert preempted[0] == "b"                           # a (older) grew; b (newest running) gave way
    assert all(len(r.output_token_ids) == r.params.max_tokens for r in (a, b, c))
    assert bm.num_free_blocks == 6


def test_prefix_hit_skips_cached_tokens_and_a_full_hit_leaves_one_token():
    bm = BlockManager(32, 4, enable_prefix_caching=True)
    sched = Scheduler(bm)
    first = make_request(0, 12, max_tokens=1)
    sched.add(first)
    run_to_end(sched)
    # the same 12-token prompt again: 3 full blocks cached, but one token must still run
    again = make_request(1, 12, max_tokens=1)
    sched.add(again)
    plan = sched.schedule()
    assert again.num_cached_tokens == 8 and plan.num_new_tokens == [4]
    finish_step(sched, plan)
    # a longer prompt sharing the first 12 tokens: all 3 blocks hit
    longer = make_request(2, 15, max_tokens=1)
    sched.add(longer)
    plan = sched.schedule()
    assert longer.num_cached_tokens == 12 and plan.num_new_tokens == [3]


def test_preemption_then_prefix_hit_resumes_from_its_own_cached_blocks():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    sched = Scheduler(bm)
    victim = make_request("v", 8, max_tokens=20)
    sched.add(victim)
    plan = sched.schedule()
    finish_step(sched, plan)
    sched._preempt(victim)                               # as the scheduler does when blocks run out
    plan = sched.schedule()
    # its 9 tokens (8 prompt + 1 output) -> 2 full blocks were cached when it was freed
    assert victim.num_computed_tokens == 8 and plan.num_new_tokens == [1]
    finish_step(sched, plan)
    assert victim.output_token_ids == [7, 7]


def test_finish_frees_blocks_of_running_and_removes_waiting():
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_seqs=1)
    a, b = make_request("a", 6), make_request("b", 6)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    assert bm.num_free_blocks == 6
    sched.finish(a)                                      # abort a running request
    sched.finish(b)                                      # and a waiting one
    assert bm.num_free_blocks == 8 and not sched.has_unfinished()


@pytest.mark.parametrize("kwargs", [dict(max_num_seqs=0), dict(max_num_batched_tokens=0),
                                    dict(max_num_seqs=1.5)])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        Scheduler(BlockManager(4, 4), **kwargs)


@pytest.mark.parametrize("prompt_len, budget, decoding", [(2000, 512, 40), (300, 64, 5), (100, 128, 3), (97, 16, 15)])
def test_chunked_prefill_steps_matches_the_scheduler(prompt_len, budget, decoding):
    sched = Scheduler(BlockManager(512, 16), max_num_seqs=64, max_num_batched_tokens=budget)
    for i in range(decoding):
        sched.add(make_request(i, 1, max_tokens=10_000))
    while len(sched.running) < decoding or any(r.num_computed_tokens == 0 for r in sched.running):
        finish_step(sched, sched.schedule())                            # admit them all: now they decode
    prompt = make_request("new", prompt_len, first_token=300)
    sched.add(prompt)
    steps = 0
    while prompt.num_computed_tokens < prompt_len:
        plan = sched.schedule()
        assert plan.num_new_tokens[:decoding] == [1] * decoding        # every decode still runs each step
        finish_step(sched, plan)
        steps += 1
    assert steps == chunked_prefill_steps(prompt_len, budget, decoding)


def test_chunked_prefill_steps_refuses_a_budget_the_decodes_fill():
    with pytest.raises(ValueError, match="num_decoding < max_num_batched_tokens"):
        chunked_prefill_steps(100, 16, 16)
