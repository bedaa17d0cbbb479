"""Speculative decoding is exact: greedy output is token-identical to plain decoding, and the
rejection sampler's output distribution is the target's (chi-square, vLLM's convergence test).
The rules and drafts are minillm/speculative/core.py; the per-request loop that runs them here is lesson 08's
teaching stage, minillm/stages/speculative_loop.py (the engine's speculation: tests/speculative/test_speculative_engine.py)."""
import pytest
import torch

from helpers import CharTokenizer, chi2_pvalue
from minillm import LLM, SamplingParams
from minillm.config import EngineConfig
from minillm.course.calculators import best_k, break_even_alpha, expected_speedup
from minillm.engine.output_processor import OutputProcessor
from minillm.engine.sampling import filtered_probs
from minillm.model.llama import random_model, tiny_config
from minillm.perf.roofline import expected_tokens_per_call
from minillm.speculative.core import (METHODS, DraftPool, ModelDraft, NgramDraft, SpecStats, acceptance_probability,
                                      check_args, default_skipped_layers, greedy_verify, layer_subset, make_draft,
                                      rejection_sample, verify)
from minillm.stages.fast_decode import FastDecoder
from minillm.stages.reference import stream_contiguous
from minillm.stages.speculative_loop import Stepper, speculative_stream

V = 10                                 # small vocabulary for the statistical tests


# ---- helpers -----------------------------------------------------------------------------------------

def sample_spec(p: torch.Tensor, q: torch.Tensor, n: int, seed: int):
    """n independent rounds with per-position distributions p (k+1, V), q (k, V)."""
    gen = torch.Generator().manual_seed(seed)
    k = q.shape[0]
    drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=gen) for i in range(k)], 1)  # (n, k)
    return rejection_sample(drafts, q.expand(n, k, V), p.expand(n, k + 1, V), gen)


def softmax_rows(rows: int, scale: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(rows, V, generator=gen)).softmax(-1)


def _random_pair(k):
    return softmax_rows(k + 1, 1.5, 1), softmax_rows(k, 1.5, 2)


def _equal_pair(k):
    p = softmax_rows(k + 1, 1.5, 3)
    return p, p[:k].clone()


def _draft_outside_support(k):
    p, q = softmax_rows(k + 1, 1.0, 4), softmax_rows(k, 1.0, 5)
    p[:, :4] = 0                                   # the target never emits tokens 0..3 ...
    q[:, :2] = 0.2                                 # ... the draft often proposes 0 and 1
    q[:, 5:7] = 0                                  # and never proposes 5, 6 (only the residual can)
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def _near_one_hot(k):
    p = torch.full((k + 1, V), 1e-4)
    p[:, 3] = 1.0
    q = torch.full((k, V), 1e-3)
    q[:, 7] = 1.0                                  # the draft is sure of a different token
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


CASES = {"random": _random_pair, "p_equals_q": _equal_pair, "draft_outside_support": _draft_outside_support,
         "near_one_hot": _near_one_hot}


class TinyLLM(LLM):
    """LLM's request life cycle around the tiny random model (LLM() itself loads checkpoints).
    The model stays unfused, so both runners take the baseline forward_cached path."""

    def __init__(self, model):
        self.device, self.model, self.tokenizer = torch.device("cpu"), model, CharTokenizer()
        self.engine_config = EngineConfig.from_kwargs(max_model_len=256)   # no speculative_method: the plain
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)   # runner; speculative_stream
                                                                           # is called directly


tiny_llm = TinyLLM


def run_plain(llm, prompt, params):
    (req,) = llm.make_requests([prompt], params)
    text = "".join(stream_contiguous(llm, req))
    return req, text


def run_spec(llm, prompt, params, method, k, draft=None):
    (req,) = llm.make_requests([prompt], params)
    stats = SpecStats()
    text = "".join(speculative_stream(llm, req, method, k, stats, draft))
    return req, text, stats


# ---- hand-built logits: exact tokens ----------------------------------------------------------------------

def test_forced_accept_accept_reject_gives_exact_tokens():
    draft = torch.tensor([[1, 2, 3]])                                  # (1, k=3)
    q = torch.zeros(1, 3, 5)
    q[0, 0, 1], q[0, 1, 2], q[0, 2, 3] = 1.0, 0.5, 1.0                 # (1, 3, V=5)
    q[0, 1, 0] = 0.5
    p = torch.zeros(1, 4, 5)
    p[0, 0, 1] = 1.0                                                   # p(d1) = q(d1): always accepted
    p[0, 1, 2] = 1.0                                                   # p(d2) > q(d2): always accepted
    p[0, 2, 4] = 1.0                                                   # p(d3) = 0: always rejected,
    p[0, 3, 0] = 1.0                                                   # residual max(0, p - q) = token 4
    for seed in range(20):
        tokens, accepted = rejection_sample(draft, q, p, torch.Generator().manual_seed(seed))
        assert accepted.tolist() == [2]
        assert tokens[0, :3].tolist() == [1, 2, 4]


def test_all_accepted_adds_the_bonus_token_from_the_last_target_distribution():
    draft = torch.tensor([[1, 2]])
    q = torch.nn.functional.one_hot(draft, 5).float()                  # (1, 2, 5)
    p = torch.nn.functional.one_hot(torch.tensor([[1, 2, 3]]), 5).float()  # (1, 3, 5): bonus = 3
    tokens, accepted = rejection_sample(draft, q, p, torch.Generator().manual_seed(0))
    assert accepted.tolist() == [2] and tokens[0].tolist() == [1, 2, 3]


def test_greedy_verify_keeps_the_matching_prefix_then_the_target_choice():
    logits = torch.full((2, 4, 6), -1.0)
    for b, row in enumerate([[1, 2, 5, 0], [1, 2, 3, 4]]):             # target argmax per position
        logits[b, torch.arange(4), torch.tensor(row)] = 1.0
    draft = torch.tensor([[1, 2, 3], [1, 2, 3]])
    tokens, accepted = greedy_verify(draft, logits)
    assert accepted.tolist() == [2, 3]
    assert tokens[0, :3].tolist() == [1, 2, 5]                         # mismatch replaced
    assert tokens[1].tolist() == [1, 2, 3, 4]                          # all accepted + bonus


# ---- statistics: the output distribution is the target's -----------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_every_emitted_position_is_distributed_as_the_target(case):
    k = 3
    p, q = CASES[case](k)
    tokens, accepted = sample_spec(p, q, 100_000, seed=11)
    for pos in range(k + 1):
        emitted = accepted >= pos                                      # rows that reached this position
        counts = torch.bincount(tokens[emitted, pos], minlength=V)
        if emitted.sum() < 1000:
            continue                                                   # near one-hot: few reach pos >= 1
        assert counts[p[pos] == 0].sum() == 0, "emitted a token outside the target's support"
        assert chi2_pvalue(counts, p[pos]) > 0.01, (case, pos)


@pytest.mark.parametrize("case", list(CASES))
def test_the_test_can_fail_a_sampler_that_skips_the_residual(case):
    """Resampling from p instead of norm(max(0, p - q)) after a rejection is a classic bug:
    the chi-square test above must reject it (except where no rejection ever happens)."""
    k = 1
    p, q = CASES[case](k)
    n = 100_000
    gen = torch.Generator().manual_seed(5)
    d = torch.multinomial(q[0], n, replacement=True, generator=gen)                  # (n,)
    accept = torch.rand(n, generator=gen) * q[0, d] < p[0, d]
    fallback = torch.multinomial(p[0], n, replacement=True, generator=gen)            # the bug
    first = torch.where(accept, d, fallback)
    pvalue = chi2_pvalue(torch.bincount(first, minlength=V), p[0])
    if case == "p_equals_q":
        assert pvalue > 0.01                                           # never rejects: bug invisible
    else:
        assert pvalue < 1e-6


def test_vllm_convergence_distance_to_target_shrinks_20x_faster_than_to_references():
    """vLLM's test: as the number of samples grows 10 -> 100000, the L2 distance between the
    output histogram and the target falls far faster than its distance to random references."""
    k = 2
    p, q = _random_pair(k)
    references = softmax_rows(8, 1.5, 99)                              # (8, V) unrelated distributions
    to_target, to_reference = [], []
    for n in (10, 100, 1_000, 10_000, 100_000):
        tokens, _ = sample_spec(p, q, n, seed=n)
        hist = torch.bincount(tokens[:, 0], minlength=V).float() / n
        to_target.append(float((hist - p[0]).norm()))
        to_reference.append(float((hist - references).norm(dim=-1).mean()))
    assert to_target[0] / to_target[-1] > 20 * (to_reference[0] / to_reference[-1])


@pytest.mark.parametrize("case", ["random", "near_one_hot", "draft_outside_support"])
def test_acceptance_rate_and_tokens_per_call_match_theory(case):
    k, n = 4, 100_000
    p, q = CASES[case](k)
    p, q = p[:1].expand(k + 1, V), q[:1].expand(k, V)                  # same p, q at every position
    alpha = float(acceptance_probability(p[0], q[0]))
    tokens, accepted = sample_spec(p, q, n, seed=3)
    first_accepted = (accepted >= 1).double()
    se = (alpha * (1 - alpha) / n) ** 0.5
    assert abs(float(first_accepted.mean()) - alpha) < 3 * se + 1e-9
    per_call = (accepted + 1).double()
    se_calls = float(per_call.std()) / n ** 0.5
    assert abs(float(per_call.mean()) - expected_tokens_per_call(alpha, k)) < 3 * se_calls + 1e-9


@pytest.mark.parametrize("deterministic_draft", [False, True])
def test_verify_samples_the_filtered_distribution(deterministic_draft):
    """The runner's glue: temperature, top-k and top-p apply to BOTH p and q, and a deterministic
    draft (n-gram) counts as q one-hot; the first emitted token follows filtered p exactly."""
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.9)
    gen = torch.Generator().manual_seed(0)
    target_logits = torch.randn(3, V, generator=gen)                   # (k+1, V), k = 2
    draft_logits = torch.randn(2, V, generator=gen)
    p0 = filtered_probs(target_logits[0], params)
    q = torch.stack([filtered_probs(row, params) for row in draft_logits])
    counts = torch.zeros(V, dtype=torch.long)
    for _ in range(5_000):
        if deterministic_draft:
            guesses, q_arg = [4, 1], None
        else:
            guesses, q_arg = [int(torch.multinomial(row, 1, generator=gen)) for row in q], q
        tokens, _ = verify(guesses, q_arg, target_logits, params, gen)
        counts[tokens[0]] += 1
    assert counts[p0 == 0].sum() == 0
    assert chi2_pvalue(counts, p0) > 0.01


# ---- the runner on the tiny random model: identical greedy tokens, every draft, k = 1..8 ---------------------

@pytest.mark.parametrize("method", METHODS)
def test_tiny_greedy_is_token_identical_to_plain_for_k_1_to_8(tiny_model, method):
    llm = tiny_llm(tiny_model)
    prompt = {"prompt_token_ids": [5, 17, 99, 5, 17, 42, 7, 5, 17]}
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain, plain_text = run_plain(llm, prompt, params)
    for k in range(1, 9):
        spec, text, stats = run_spec(llm, prompt, params, method, k)
        assert spec.output_token_ids == plain.output_token_ids, (method, k)
        assert text == plain_text and spec.finish_reason == "length"
        assert stats.emitted == len(plain.output_token_ids) - 1        # all but the prefill's token
        if method != "ngram":
            assert stats.drafted > 0


def test_tiny_bf16_draft_accepts_almost_everything(tiny_model):
    """Internals: a draft close to the target is accepted; an unrelated one is not."""
    llm = tiny_llm(tiny_model)
    prompt = {"prompt_token_ids": [3, 1, 4, 1, 5, 9, 2, 6]}
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    _, _, close = run_spec(llm, prompt, params, "draft", 4)
    unrelated = ModelDraft(random_model(tiny_config(), seed=123))
    _, _, far = run_spec(llm, prompt, params, "draft", 4, draft=unrelated)
    assert close.acceptance_rate > 0.9
    assert far.acceptance_rate < 0.5 and far.tokens_per_call < close.tokens_per_call


def test_draft_rollback_leaves_a_cache_equal_to_a_fresh_one(tiny_model):
    """Both caches a speculative round rolls back: the draft model's (ModelDraft, its paged cache
    written by position) and the teaching loop's target (Stepper: the contiguous KVCache, truncated)."""
    context = [7, 8, 9, 10, 11]
    greedy = SamplingParams(temperature=0)
    used = ModelDraft(tiny_model)
    used.reset(64)
    guesses, _ = used.propose(context, 5, greedy, None)
    assert used.length == len(context) + 4                             # d_k is never fed
    used.rollback(len(context) + 2)                                    # keep two guesses
    context2 = context + guesses[:2] + [3]                             # plus the target's token
    fresh = ModelDraft(tiny_model)
    fresh.reset(64)
    assert used.propose(context2, 4, greedy, None)[0] == fresh.propose(context2, 4, greedy, None)[0]
    assert used.length == fresh.length
    decoder = FastDecoder(tiny_model)
    target = Stepper(decoder, 64)
    target.step(context + guesses)
    target.rollback(len(context) + 2)                                  # KVCache.truncate
    again = Stepper(decoder, 64)
    torch.testing.assert_close(target.step([3]), again.step(context2), rtol=1e-5, atol=1e-5)
    assert target.length == again.length == len(context2)


def test_draft_pool_shared_by_requests_grows_and_takes_its_blocks_back(tiny_model):
    """ModelDrafts sharing one DraftPool (the engine's way) each hold their own blocks and propose what a
    draft alone proposes; when the free list runs out the pool doubles, the cached blocks copied across
    (a draft that was mid-sequence goes on unchanged); release() gives the blocks back."""
    greedy = SamplingParams(temperature=0)
    pool = DraftPool(tiny_model, 64, num_blocks=2, block_size=4)
    contexts = [[7, 8, 9, 10, 11], [3, 1, 4, 1, 5, 9, 2, 6]]
    drafts = [ModelDraft(tiny_model, pool) for _ in contexts]
    for draft in drafts:
        draft.reset(64)
    first = [draft.propose(c, 4, greedy, None)[0] for draft, c in zip(drafts, contexts)]
    assert pool.num_blocks > 2 and set(drafts[0].blocks).isdisjoint(drafts[1].blocks)
    for draft, c, guesses in zip(drafts, contexts, first):
        alone = ModelDraft(tiny_model)
        alone.reset(64)
        assert alone.propose(c, 4, greedy, None)[0] == guesses
        draft.rollback(len(c) + 1)                                     # one guess accepted, then the target's token
        longer = c + guesses[:1] + [2]
        again = ModelDraft(tiny_model)
        again.reset(64)
        assert draft.propose(longer, 6, greedy, None)[0] == again.propose(longer, 6, greedy, None)[0]
    assert len(pool.free) + sum(len(d.blocks) for d in drafts) == pool.num_blocks
    for draft in drafts:
        draft.release()
    assert len(pool.free) == pool.num_blocks and drafts[0].length == 0
    with pytest.raises(ValueError, match="does not fit"):
        drafts[0].reset(65)


def test_tiny_seeded_sampling_reproduces_and_respects_max_tokens(tiny_model):
    llm = tiny_llm(tiny_model)
    prompt = {"prompt_token_ids": [1, 2, 3, 4]}
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=25, seed=7, ignore_eos=True)
    a, _, _ = run_spec(llm, prompt, params, "draft", 3)
    b, _, _ = run_spec(llm, prompt, params, "draft", 3)
    c, _, _ = run_spec(llm, prompt, SamplingParams(temperature=1.0, top_p=0.95, max_tokens=25, seed=8,
                                                   ignore_eos=True), "draft", 3)
    assert a.output_token_ids == b.output_token_ids != c.output_token_ids
    assert len(a.output_token_ids) == 25


def test_tiny_eos_inside_an_accepted_run_stops_there(tiny_model):
    llm = tiny_llm(tiny_model)
    prompt = {"prompt_token_ids": [9, 8, 7]}
    long_run = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    plain, _ = run_plain(llm, prompt, long_run)
    llm.tokenizer.eos_token_id = plain.output_token_ids[20]           # a token it emits mid-stream
    params = SamplingParams(temperature=0, max_tokens=60, logprobs=2)
    expect, expect_text = run_plain(llm, prompt, params)
    got, text, _ = run_spec(llm, prompt, params, "draft", 8)
    assert got.output_token_ids == expect.output_token_ids and text == expect_text
    assert got.finish_reason == "stop" and got.output_token_ids[-1] == llm.tokenizer.eos_token_id
    assert [list(e) for e in got.output_logprobs] == [list(e) for e in expect.output_logprobs]
    assert got.cumulative_logprob == pytest.approx(expect.cumulative_logprob, abs=1e-4)


# ---- drafts and arguments -----------------------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_match():
    ngram = NgramDraft(max_n=3, min_n=1)
    greedy = SamplingParams(temperature=0)
    assert ngram.propose([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3], 3, greedy, None)[0] == [8, 5, 1]
    assert ngram.propose([4, 5, 6, 7, 5], 2, greedy, None)[0] == [6, 7]   # falls back to n = 1
    assert ngram.propose([1, 2, 3], 4, greedy, None)[0] == []              # nothing to match


def test_layer_subset_shares_weights_and_skips_the_default_layers(tiny_model):
    assert default_skipped_layers(30) == [12, 14, 16, 18]
    sub = layer_subset(tiny_model, [0])
    assert sub.layers[0] is tiny_model.layers[0] and sub.embed is tiny_model.embed
    assert sub.cfg.n_layers == 1 and tiny_model.cfg.n_layers == 2


def test_bad_arguments_are_clear_errors(tiny_model):
    llm = tiny_llm(tiny_model)
    (req,) = llm.make_requests([{"prompt_token_ids": [1, 2]}], SamplingParams(temperature=0, max_tokens=2))
    with pytest.raises(ValueError, match="speculative_method"):
        make_draft(tiny_model, "medusa")
    for k in (0, 17, 2.5, True):
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            next(speculative_stream(llm, req, "ngram", k))
    with pytest.raises(ValueError, match="speculative_method"):
        check_args("eagle", 4)
    with pytest.raises(ValueError, match="min_n"):
        NgramDraft(max_n=1, min_n=2)


# ---- the real model -----------------------------------------------------------------------------------------

PARAGRAPH = ("The old lighthouse stood on the edge of the cliff for more then two hundred years. Every night "
             "its lamp turned slowly, and ships that past the rocks trusted it's light to guide them home.")


@pytest.fixture(scope="module")
def grounded_prompt(llm):
    return llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Fix the spelling mistakes in this paragraph and return the corrected "
                                     "paragraph:\n\n" + PARAGRAPH}])


# The real model at the smallest, a middle and the largest k (each k re-runs the whole request); the
# tiny model covers every k from 1 to 8 (test_tiny_greedy_is_token_identical_to_plain_for_k_1_to_8).
REAL_MODEL_KS = (1, 3, 8)


@pytest.mark.usefixtures("fresh_compile_caches")     # the verify step's shapes are this model's, not earlier tests'
def test_real_model_greedy_identical_ngram_k_1_3_8(llm, grounded_prompt):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain, plain_text = run_plain(llm, grounded_prompt, params)
    for k in REAL_MODEL_KS:
        spec, text, stats = run_spec(llm, grounded_prompt, params, "ngram", k)
        assert spec.output_token_ids == plain.output_token_ids, k
        assert text == plain_text
    assert stats.tokens_per_call > 1.5                                  # it copies the paragraph


@pytest.mark.parametrize("method", ["draft", "layerskip"])
def test_real_model_greedy_identical_model_drafts_k_1_3_8(llm, grounded_prompt, method):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    plain, _ = run_plain(llm, grounded_prompt, params)
    for k in REAL_MODEL_KS:
        spec, _, _ = run_spec(llm, grounded_prompt, params, method, k)
        assert spec.output_token_ids == plain.output_token_ids, (method, k)


def test_real_model_stop_string_inside_an_accepted_run(llm, grounded_prompt):
    params = SamplingParams(temperature=0, max_tokens=40, stop=["hundred"])
    plain, plain_text = run_plain(llm, grounded_prompt, params)
    spec, text, _ = run_spec(llm, grounded_prompt, params, "ngram", 8)
    assert plain.finish_reason == spec.finish_reason == "stop" and plain.stop_reason == "hundred"
    assert spec.text == plain.text and text == plain_text
    assert spec.output_token_ids == plain.output_token_ids


def test_expected_speedup_charges_drafting_and_verification():
    assert expected_tokens_per_call(0.8, 4) == pytest.approx(3.3616)
    assert expected_speedup(0.8, 4, 0.05) == pytest.approx(3.3616 / 1.2)
    assert expected_speedup(1.0, 8, 0.81, verify_cost=2.16) == pytest.approx(9 / (8 * 0.81 + 2.16))


@pytest.mark.parametrize("k, c, v", [(3, 0.2, 2.05), (4, 0.05, 1.0), (1, 0.0, 1.5)])
def test_break_even_alpha_is_where_the_expected_speedup_is_one(k, c, v):
    alpha = break_even_alpha(k, c, v)
    assert expected_speedup(alpha, k, c, v) == pytest.approx(1.0, abs=1e-9)
    assert expected_speedup(alpha - 0.01, k, c, v) < 1 < expected_speedup(alpha + 0.01, k, c, v)
    assert break_even_alpha(3, 1.0, 2.0) == 1.0                        # 4 tokens can never pay 5 steps

@pytest.mark.parametrize("alpha, cost", [(0.8, 0.05), (0.8, 0.2), (0.5, 0.1), (0.95, 0.01)])
def test_best_k_maximises_the_expected_speedup(alpha, cost):
    k = best_k(alpha, cost, max_k=8)
    assert all(expected_speedup(alpha, k, cost) >= expected_speedup(alpha, j, cost) for j in range(1, 9))
    assert best_k(0.8, 0.05) == 8 and best_k(0.8, 0.2) == 4          # cheaper drafts afford more guesses


# ---- the batch-1 runner's parts: n-gram search, verification step, rollback ------------------------------

def _ngram_reference(context, k, max_n, min_n):
    """The nested loops NgramDraft.propose used to run: for n = max_n .. min_n, every earlier start,
    latest first; what followed the first match found."""
    for n in range(min(max_n, len(context) - 1), min_n - 1, -1):
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == tail:
                return context[start + n:start + n + k]
    return []


def test_ngram_vectorised_search_proposes_exactly_what_the_loops_did():
    """Random contexts over small vocabularies (many matches, of every length) and large ones (few),
    every k and n range: the same proposal, including 'nothing' and a match near the end (short follow)."""
    gen = torch.Generator().manual_seed(0)
    greedy = SamplingParams(temperature=0)
    for trial in range(400):
        vocab = (2, 3, 5, 40)[trial % 4]
        context = torch.randint(vocab, (int(torch.randint(0, 50, (), generator=gen)),), generator=gen).tolist()
        k = int(torch.randint(0, 9, (), generator=gen))
        min_n = 1 + trial % 3
        max_n = min_n + trial // 3 % 3
        got = NgramDraft(max_n, min_n).propose(context, k, greedy, None)
        assert got == (_ngram_reference(context, k, max_n, min_n), None), (context, k, max_n, min_n)


def test_step_all_on_a_fused_model_runs_the_verify_step_and_rolls_back_without_copying(tiny_model, monkeypatch):
    """A fused model verifies through FastDecoder.verify (run eagerly here: the compiled layers have
    their own tests in test_fast_decode.py) with forward_cached's logits; rollback only shortens the
    cache, and the next round overwrites the rejected positions."""
    from minillm.stages import fast_decode

    calls = []
    verify_step = FastDecoder.verify

    def counting(self, ids, cache, rope):
        calls.append(ids.shape[1])
        return verify_step(self, ids, cache, rope)

    monkeypatch.setattr(FastDecoder, "verify", counting)
    monkeypatch.setattr(fast_decode, "_compiled_verify_layer", fast_decode.verify_layer)
    monkeypatch.setattr(fast_decode, "_compiled_dot", fast_decode._rowwise_dot)   # the prefill's LM head GEMV
    context, guesses = [5, 17, 99, 5, 17, 42, 7], [5, 17, 99, 5]
    baseline = Stepper(FastDecoder(tiny_model), 32)                    # not fused: forward_cached
    baseline.step(context)
    want = baseline.step_all(guesses)                                  # (4, V)
    assert calls == []
    fast_decode.fuse_projections(tiny_model)
    fast = Stepper(FastDecoder(tiny_model), 32)
    fast.step(context)
    keys = fast.cache.k.data_ptr()
    torch.testing.assert_close(fast.step_all(guesses), want, rtol=1e-5, atol=1e-5)
    fast.rollback(len(context) + 1)                                    # one guess accepted
    assert fast.length == len(context) + 1 and fast.cache.k.data_ptr() == keys
    torch.testing.assert_close(fast.step_all(guesses[1:]), want[1:], rtol=1e-5, atol=1e-5)
    assert calls == [4, 3]
