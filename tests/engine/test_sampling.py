"""The sampler: greedy, temperature, top-k, top-p, seeds; and SamplingParams validation."""
import pytest
import torch

from minillm.engine.sampling import SamplingParams, filtered_probs, make_generator, sample

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def _draws(params, n=4000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.tensor([sample(LOGITS, params, gen) for _ in range(n)])


def test_greedy_is_argmax_and_draws_nothing():
    p = SamplingParams(temperature=0)
    assert sample(LOGITS, p, None) == 0 and make_generator(p, torch.device("cpu")) is None


def test_temperature_sampling_matches_softmax():
    draws = _draws(SamplingParams(temperature=0.8))
    freq = torch.bincount(draws, minlength=6).float() / len(draws)
    expected = (LOGITS / 0.8).softmax(-1)
    # 4000 draws: standard error <= 0.008; allow 4 sigma
    assert (freq - expected).abs().max() < 0.032


def test_top_k_keeps_only_k_tokens():
    draws = _draws(SamplingParams(temperature=1.0, top_k=2))
    assert set(draws.tolist()) == {0, 1}
    probs = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(probs[:2], LOGITS[:2].softmax(-1)) and probs[2:].sum() == 0


def test_top_k_beyond_the_vocabulary_keeps_every_token():
    for top_k in (LOGITS.numel(), 10**30):          # as vLLM: a k past the vocabulary filters nothing
        probs = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_k=top_k))
        assert torch.allclose(probs, LOGITS.softmax(-1))


def test_seeds_at_the_ends_of_the_range_are_usable():
    for seed in (-2**63, 2**64 - 1):
        assert _seeded_draws(seed, n=5) == _seeded_draws(seed, n=5)


def test_top_p_keeps_smallest_set_reaching_p():
    full = LOGITS.softmax(-1)                       # 0.54, 0.20, 0.12, ...
    probs = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.7))
    kept = (probs > 0).nonzero().flatten().tolist()
    assert kept == [0, 1]                           # 0.54 < 0.7 <= 0.54 + 0.20
    assert torch.allclose(probs[:2], full[:2] / full[:2].sum())
    tiny = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.01))
    assert (tiny > 0).nonzero().flatten().tolist() == [0]   # the top token always survives


def _seeded_draws(seed, n=50):
    p = SamplingParams(temperature=1.0, seed=seed)
    g = make_generator(p, torch.device("cpu"))
    return [sample(LOGITS, p, g) for _ in range(n)]


def test_seed_reproducible_and_different_seeds_differ():
    assert _seeded_draws(7) == _seeded_draws(7)
    assert _seeded_draws(7) != _seeded_draws(8)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"), (dict(top_k=-2), "top_k"), (dict(max_tokens=0), "max_tokens"),
    (dict(seed=1.5), "seed"), (dict(seed=2**64), "seed"), (dict(seed=-2**63 - 1), "seed"),
    (dict(stop=[""]), "stop"), (dict(logprobs=-1), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
])
def test_bad_params_name_the_argument(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} .* allowed"):
        SamplingParams(**kwargs)
