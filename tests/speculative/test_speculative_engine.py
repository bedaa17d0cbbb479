"""Speculative decoding inside the batching engine (minillm/speculative/engine.py).

Exactness: greedy outputs identical to the engine without speculation, for every proposer,
under batching, preemption and prefix-cache hits; sampled outputs distributed as the target's.
Every test also checks that drafts were really verified (accepted ones among them), so a run that
silently fell back to plain decoding cannot pass.
"""
import pytest
import torch

from helpers import TEACHING_STAGES, CharTokenizer, chi2_pvalue, modules_entered, random_prompts, second_token_marginal
from minillm import LLM, SamplingParams
from minillm.course.calculators import crossover_batch, roofline_speedup
from minillm.model.llama import random_model, tiny_config
from minillm.speculative.core import StepCostModel, plan_draft_lengths

LENGTHS = [1, 5, 17, 33, 64, 100, 3, 40]
MAX_TOKENS = [5, 20, 1, 33, 12, 8, 40, 16]


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(), seed=0)


def make_llm(model, **kwargs):
    return LLM(model=model, tokenizer=CharTokenizer(), device="cpu", max_model_len=256, **kwargs)


def workload(vocab):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(LENGTHS, vocab)]
    return prompts, [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]


def token_ids(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_drafts_were_verified(llm):
    spec = llm.engine.speculation
    assert spec.drafted > 0 and 0 < spec.accepted <= spec.drafted
    log = list(llm.engine.step_log)
    assert sum(s["num_draft_tokens"] for s in log) == spec.drafted
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks   # no leak


@pytest.mark.parametrize("method", ["ngram", "draft"])     # layerskip: the stop test below
def test_greedy_equals_the_engine_without_speculation(model, method):
    prompts, params = workload(model.cfg.vocab_size)
    expected = token_ids(make_llm(model), prompts, params)
    spec = make_llm(model, speculative_method=method, num_speculative_tokens=4, speculative_policy="always")
    assert token_ids(spec, prompts, params) == expected
    assert_drafts_were_verified(spec)
    assert spec.engine.step_log[0]["num_seqs"] > 1                     # they really shared steps


# ---- the draft model runs on the production forward, never through a teaching stage ----------------

def library_imports(start: str) -> set[str]:
    """minillm modules reachable from module `start` through its imports (module level or inside a
    function, read from the source: what can be imported, whatever ran before in this process)."""
    import ast
    from pathlib import Path

    top = Path(__file__).resolve().parents[2]

    def path_of(name):
        for p in (top / (name.replace(".", "/") + ".py"), top / name.replace(".", "/") / "__init__.py"):
            if p.exists():
                return p
        return None

    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = path_of(name)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                found = [module] + [f"{module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            else:
                continue
            todo += [m for m in found if m.startswith("minillm") and path_of(m) is not None]
    return seen


@pytest.mark.usefixtures("fresh_compile_caches")     # conftest: compiled here, not eager past Dynamo's recompile limit
@pytest.mark.parametrize("method", ["draft", "layerskip"])
def test_model_drafts_run_on_the_production_forward_and_never_enter_a_teaching_stage(model, method):
    """The engine's speculation with a draft model: greedy output identical to the engine without
    speculation (fp32), the drafts verified, the draft model stepped by its DraftPool's ModelRunner
    (one-token draft steps on the compiled decode step), and no teaching stage (fast_decode, the
    per-request loop, the contiguous cache) entered while it runs, nor importable from the engine's
    speculation."""
    prompts, params = workload(model.cfg.vocab_size)
    expected = token_ids(make_llm(model), prompts, params)
    spec = make_llm(model, speculative_method=method, num_speculative_tokens=4, speculative_policy="always")
    token_ids(spec, prompts[:2], params[:2])                           # warm-up: compiles, allocates
    got = []
    entered = modules_entered(lambda: got.append(token_ids(spec, prompts, params)))
    assert got == [expected]
    assert_drafts_were_verified(spec)
    assert not entered & (TEACHING_STAGES | {"minillm.stages.speculative_loop"}), entered & TEACHING_STAGES
    assert {"minillm.speculative.engine", "minillm.speculative.core", "minillm.model.runner", "minillm.model.layer"} <= entered
    speculation = spec.engine.speculation
    pool = speculation.pool
    assert pool.runner.compiled_decode_steps > 0 and pool.runner.compile_failed is None
    held = sum(len(r.drafter.blocks) for r in speculation.drafting)
    assert len(pool.free) + held == pool.num_blocks                    # no block lost
    speculation.propose([], 1)                                         # the next step: finished ones give back
    assert not speculation.drafting and len(pool.free) == pool.num_blocks
    for start in ("minillm.speculative.engine", "minillm.llm"):
        assert not library_imports(start) & {"minillm.stages.fast_decode", "minillm.stages.speculative_loop", "minillm.stages.reference"}


def test_greedy_equal_under_preemption_and_a_tight_budget(model):
    """A pool of 24 blocks of 8 tokens (the workload needs 410 slots) forces preemption (recompute);
    a budget of 48 tokens per step cuts drafts short when the batch is full."""
    prompts, params = workload(model.cfg.vocab_size)
    small = dict(block_size=8, num_kv_blocks=24, max_num_batched_tokens=48, max_model_len=160)
    expected = token_ids(LLM(model=model, tokenizer=CharTokenizer(), device="cpu", **small), prompts, params)
    spec = LLM(model=model, tokenizer=CharTokenizer(), device="cpu", **small, speculative_method="ngram",
               num_speculative_tokens=6, speculative_policy="always")
    assert token_ids(spec, prompts, params) == expected
    assert_drafts_were_verified(spec)
    assert sum(s["num_preempted"] for s in spec.engine.step_log) > 0


def test_greedy_equal_with_prefix_cache_hits(model):
    """Requests that share a 48-token head: later ones hit the prefix cache; accepted drafts become
    cached blocks that must hold exactly the tokens other requests then reuse."""
    head = random_prompts([48], model.cfg.vocab_size, seed=3)[0]
    tails = random_prompts([3, 9, 1, 20, 5, 12], model.cfg.vocab_size, seed=4)
    prompts = [{"prompt_token_ids": head + t} for t in tails]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (30, 12, 25, 8, 40, 16)]
    plain = make_llm(model, enable_prefix_caching=True, block_size=8)
    expected = token_ids(plain, prompts[:1], params[:1]) + token_ids(plain, prompts[1:], params[1:])
    spec = make_llm(model, enable_prefix_caching=True, block_size=8, speculative_method="ngram",
                    num_speculative_tokens=4, speculative_policy="always")
    first = spec.generate(prompts[:1], params[:1], use_tqdm=False)      # fills the cache
    requests = spec.make_requests(prompts[1:], params[1:])
    spec.engine.run(requests)                                           # later ones hit it
    assert [o.outputs[0].token_ids for o in first] + [r.output_token_ids for r in requests] == expected
    assert sum(r.num_cached_tokens for r in requests) >= 5 * 40
    spec_engine = spec.engine.speculation
    assert spec_engine.drafted > 0 and spec_engine.accepted > 0


def test_stop_strings_and_max_tokens_inside_an_accepted_run(model):
    prompts, params = workload(model.cfg.vocab_size)
    expected = token_ids(make_llm(model), prompts, params)
    spec = make_llm(model, speculative_method="layerskip", num_speculative_tokens=8, speculative_policy="always")
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert [len(o.outputs[0].token_ids) for o in outs] == MAX_TOKENS
    assert_drafts_were_verified(spec)
    # a stop string taken from the middle of each reference output must cut it at the same place
    tok = CharTokenizer()
    stops = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, stop=[tok.decode(e[m // 2:m // 2 + 2])])
             for m, e in zip(MAX_TOKENS, expected) if m >= 4]
    kept = [p for p, m in zip(prompts, MAX_TOKENS) if m >= 4]
    plain_text = [o.outputs[0].text for o in make_llm(model).generate(kept, stops, use_tqdm=False)]
    assert [o.outputs[0].text for o in spec.generate(kept, stops, use_tqdm=False)] == plain_text


def test_sampled_tokens_are_distributed_as_the_target(model):
    """T = 1 on a 16-token vocabulary: the prompt holds every token once, so the n-gram proposer
    always drafts (what followed the first token in the prompt) and the rejection sampler decides.
    The second token's distribution over 1500 seeds must match the exact marginal
    p(x2) = sum_x1 p(x1) p(x2 | x1) computed from the model."""
    small = random_model(tiny_config(vocab_size=16), seed=1)
    prompt = list(torch.randperm(16, generator=torch.Generator().manual_seed(0)).tolist())
    p2 = second_token_marginal(small, prompt)                           # (V,) the exact marginal
    spec = LLM(model=small, tokenizer=CharTokenizer(), device="cpu", max_model_len=64, max_num_seqs=256,
               speculative_method="ngram", num_speculative_tokens=1, speculative_policy="always")
    n = 1500
    params = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=s) for s in range(n)]
    outs = spec.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    second = torch.tensor([o.outputs[0].token_ids[1] for o in outs])
    stats = spec.engine.speculation
    assert stats.drafted >= n and 0 < stats.accepted < stats.drafted   # both branches ran
    assert chi2_pvalue(torch.bincount(second, minlength=16), p2.double()) > 0.001
    # the same test rejects the draft's own distribution: the drafts alone are not the target's
    drafts = torch.tensor([prompt[(prompt.index(o.outputs[0].token_ids[0]) + 1) % 16] for o in outs])
    assert chi2_pvalue(torch.bincount(drafts, minlength=16), p2.double()) < 1e-6


# ---- the adaptive policy ---------------------------------------------------------------------------

def test_drafts_pay_at_batch_1_and_fade_out_when_the_step_is_compute_bound():
    """t(N) = a + b N. At batch 1 a draft adds b to a step of a: it pays while alpha^j > b E / t,
    about b / a = 1/16 here: with alpha = 0.9 all 8 drafts pay (0.9^8 = 0.43); with alpha = 0.5
    the 4th does not (0.5^4 = 0.0625 < 0.00125 * 1.875 / 0.02375 = 0.099). At batch 64 the step is
    compute-bound (64 b = 4 a): a draft must be accepted with probability above
    b E / t = 64 b / (a + 64 b) = 0.8 to pay."""
    a, b = 0.020, 0.020 / 16
    assert plan_draft_lengths([0.9], [8], 1, 1, (a, b)) == [8]
    assert plan_draft_lengths([0.5], [8], 1, 1, (a, b)) == [3]
    busy = plan_draft_lengths([0.5] * 64, [8] * 64, 64, 64, (a, b))
    assert busy == [0] * 64
    mixed = plan_draft_lengths([0.95] * 4 + [0.5] * 60, [8] * 64, 64, 64, (a, b))
    assert all(k > 0 for k in mixed[:4]) and mixed[4:] == [0] * 60
    assert plan_draft_lengths([0.5] * 64, [8] * 64, 64, 64, None) == [8] * 64   # unknown cost: explore


def test_each_draft_taken_raises_the_expected_throughput():
    a, b = 0.010, 0.001
    alphas, room = [0.9, 0.6, 0.3, 0.8], [5, 5, 5, 5]
    ks = plan_draft_lengths(alphas, room, 4, 4, (a, b))

    def throughput(ks):
        expected = sum(sum(al ** j for j in range(k + 1)) for al, k in zip(alphas, ks))
        return expected / (a + b * (4 + sum(ks)))

    best = throughput(ks)
    for i in range(4):                                                 # one draft more or less anywhere: no better
        for step in (-1, 1):
            other = list(ks)
            other[i] += step
            if 0 <= other[i] <= room[i]:
                assert throughput(other) <= best + 1e-12


def test_step_cost_model_recovers_a_line_and_refuses_without_spread():
    cost = StepCostModel()
    for n in (4, 4, 4, 4):
        cost.observe(n, 0.01)
    assert cost.fit() is None                                          # every step ran 4 tokens
    for n in (1, 8, 16, 32, 64):
        cost.observe(n, 0.010 + 0.0005 * n)
    a, b = cost.fit()
    assert a == pytest.approx(0.010 + 0.0005 * 4 * 0, abs=2e-3) and b == pytest.approx(0.0005, rel=0.1)


def test_adaptive_policy_switches_drafts_off_when_they_do_not_pay(model):
    """With a cost model where every token costs as much as the whole weight read, low-acceptance
    drafts never pay: the engine runs (almost) plain, and outputs stay identical."""
    prompts, params = workload(model.cfg.vocab_size)
    expected = token_ids(make_llm(model), prompts, params)
    spec = make_llm(model, speculative_method="layerskip", num_speculative_tokens=4)
    spec.engine.speculation.cost.fit = lambda: (0.001, 0.001)
    spec.engine.speculation.accepted, spec.engine.speculation.rejections = 0, 50   # a poor record so far
    assert token_ids(spec, prompts, params) == expected
    assert spec.engine.speculation.drafted == 0


def test_bad_policy_is_a_clear_error(model):
    with pytest.raises(ValueError, match="speculative_policy"):
        make_llm(model, speculative_method="ngram", speculative_policy="sometimes")


def test_roofline_crossover_is_where_the_speedup_falls_to_one():
    """Below the ridge drafts are free (speedup = tokens per call); past it plain decoding is
    compute-bound too and speculation keeps only E / (1 + k); the crossover sits in between."""
    ridge, k = 206.0, 4
    assert roofline_speedup(1.0, k, 1, ridge) == pytest.approx(5.0)
    assert roofline_speedup(0.8, k, 1, ridge) == pytest.approx(3.3616)      # 1 + .8 + .8^2 + .8^3 + .8^4
    assert roofline_speedup(0.8, k, 1000, ridge) == pytest.approx(3.3616 / 5)
    b = crossover_batch(0.8, k, ridge)
    assert b == pytest.approx(ridge * 3.3616 / 5)
    assert roofline_speedup(0.8, k, int(b) - 1, ridge) > 1 > roofline_speedup(0.8, k, int(b) + 2, ridge)
