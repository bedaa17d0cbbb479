"""Speculation with structured output (minillm/speculative/engine.py: guided_drafts, guided_rows):
drafts end where the grammar forbids one, the target's rows are masked by the grammar state each
continues, and the output is the guided target's: identical greedy tokens in the engine, and the
masked distribution under rejection sampling (chi-square), a sampled draft that proposes a
forbidden token included."""
from types import SimpleNamespace

import pytest
import torch

from helpers import CharTokenizer, chi2_pvalue
from minillm import LLM, GuidedDecodingParams, SamplingParams
from minillm.engine.sampling import filtered_probs
from minillm.guided.regex import compile_regex
from minillm.guided.token_automaton import TokenAutomaton, TokenVocabulary
from minillm.model.llama import random_model, tiny_config
from minillm.speculative.core import verify
from minillm.speculative.engine import guided_drafts, guided_rows

V = 10                                                        # tokens "a".."j"


def guide(pattern: str):
    automaton = TokenAutomaton(compile_regex(pattern), TokenVocabulary([bytes([97 + i]) for i in range(V)], None))
    return SimpleNamespace(automaton=automaton, state=automaton.start)


def test_drafts_end_at_the_first_forbidden_one():
    g = guide("[a-c][d-f][a-j]")
    assert guided_drafts(g, [0, 4, 9], None) == ([0, 4, 9], None)
    assert guided_drafts(g, [0, 0, 9], None) == ([0], None)          # deterministic: the forbidden one goes
    q = torch.full((3, V), 1 / V)
    drafts, kept = guided_drafts(g, [0, 0, 9], q)
    assert drafts == [0, 0] and kept.shape == (2, V)                  # sampled: it stays, to be rejected
    rows = guided_rows(g, [0, 4], torch.zeros(3, V))
    assert torch.isinf(rows[0, 3:]).all() and not torch.isinf(rows[0, :3]).any()
    assert torch.isinf(rows[1, :3]).all() and not torch.isinf(rows[1, 3:6]).any()


@pytest.mark.parametrize("deterministic_draft", [False, True])
def test_rejection_sampling_keeps_the_guided_distribution(deterministic_draft):
    """The first emitted token follows the target's distribution masked by the grammar, whether
    the draft proposes allowed or forbidden tokens."""
    params = SamplingParams(temperature=0.8)
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(3, V, generator=gen)                         # (k + 1, V)
    q = torch.stack([filtered_probs(row, params) for row in torch.randn(2, V, generator=gen)])   # (k, V)
    g = guide("[b-f][a-j][a-j]")
    p0 = filtered_probs(target[0].masked_fill(~g.automaton.mask(g.state), float("-inf")), params)
    counts = torch.zeros(V, dtype=torch.long)
    forbidden_drafted = 0
    for i in range(6_000):
        if deterministic_draft:
            guesses, q_arg = [i % V, 3], None                         # "a" (forbidden) one time in ten
        else:
            guesses, q_arg = [int(torch.multinomial(row, 1, generator=gen)) for row in q], q
        forbidden_drafted += guesses[0] not in range(1, 6)
        drafts, q_kept = guided_drafts(g, guesses, q_arg)
        tokens, _ = verify(drafts, q_kept, guided_rows(g, drafts, target[:len(drafts) + 1]), params, gen)
        counts[tokens[0]] += 1
    assert forbidden_drafted > 500
    assert counts[p0 == 0].sum() == 0
    assert chi2_pvalue(counts, p0) > 0.01


NESTED = 'root ::= "[" item ("," item)* "]"\nitem ::= [0-9]+ | root'
PROMPTS = [{"prompt_token_ids": [5, 9, 40, 7]}, {"prompt_token_ids": [60, 3]}, {"prompt_token_ids": [11] * 9}]


def tiny_llm(**kwargs):
    return LLM(model=random_model(tiny_config(), seed=0), tokenizer=CharTokenizer(), device="cpu", max_model_len=128,
               num_kv_blocks=48, **kwargs)


@pytest.mark.parametrize("method", ["ngram", "layerskip"])
def test_guided_greedy_with_speculation_is_token_identical(method):
    """A recursive grammar and a regex, guided rows beside a free one, in the engine with drafts."""
    plain = tiny_llm()
    spec = tiny_llm(speculative_method=method, num_speculative_tokens=4, speculative_policy="always")
    params = [SamplingParams(temperature=0, max_tokens=40, guided_decoding=GuidedDecodingParams(grammar=NESTED)),
              SamplingParams(temperature=0, max_tokens=16),
              SamplingParams(temperature=0, max_tokens=12, guided_decoding=GuidedDecodingParams(regex="[0-9]{3}[a-z]+"))]
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
    assert spec.engine.block_manager.num_free_blocks == spec.engine.block_manager.num_blocks
    alone = tiny_llm(speculative_method=method, num_speculative_tokens=4, speculative_policy="always")
    out, = alone.generate(PROMPTS[2:], params[0], use_tqdm=False)                # a guided row alone
    assert out.outputs[0].token_ids == plain.generate(PROMPTS[2:], params[0], use_tqdm=False)[0].outputs[0].token_ids
    assert alone.engine.speculation.accepted > 0                                  # ... drafted, and accepted


def test_jump_forward_requests_do_not_draft():
    """Forced runs would land between the drafts: a request that jumps forward is not given any."""
    spec = tiny_llm(speculative_method="ngram", num_speculative_tokens=4, speculative_policy="always")
    commas = GuidedDecodingParams(regex=",+")                          # token 11 is ",": the n-gram's guess
    req, = spec.make_requests([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=8, guided_decoding=commas))
    req.guide.jump_forward = True
    req.num_computed_tokens = req.num_tokens - 1
    spec.engine.speculation.propose([req], 64)
    assert req.spec_token_ids == []
    req.guide.jump_forward = False
    spec.engine.speculation.propose([req], 64)
    assert req.spec_token_ids                                          # same request, drafts once allowed
