"""EAGLE drafts inside the engine (speculative_method="eagle"): the runner returns the target's features, each
request's EagleDraft feeds them to the head incrementally and drafts on its own predictions.

Exactness as for every method: greedy tokens identical to the engine without speculation (under batching,
preemption and prefix-cache hits), sampled tokens distributed as the target's; and the incremental head cache
drafts exactly what the head drafts from scratch over the whole context."""
import copy
import tempfile

import pytest
import torch

from helpers import CharTokenizer, chi2_pvalue, random_prompts, sampled_second_tokens, second_token_marginal
from minillm import LLM, SamplingParams
from minillm.model.llama import random_model, tiny_config
from minillm.speculative.eagle import EagleDraft, HeadConfig, save_head, target_features, train_head
from minillm.stages.kv_cache import generate_greedy

LENGTHS = [1, 5, 17, 33, 64, 3]
MAX_TOKENS = [5, 20, 33, 12, 40, 16]


def trained_head(target, vocab: int, steps: int, seed: int = 0):
    prompts = [torch.randint(0, vocab, (6,), generator=torch.Generator().manual_seed(seed + i)).tolist()
               for i in range(24)]
    sequences = [p + out for p, out in zip(prompts, generate_greedy(target, prompts, 40))]
    head, _ = train_head(target, sequences, HeadConfig(draft_vocab=min(128, vocab), steps=steps, batch=4,
                                                       seq_len=32, lr=3e-3))
    return head


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target = random_model(tiny_config(tie_embeddings=True), seed=0)
    head = trained_head(target, 256, 80)
    path = tmp_path_factory.mktemp("eagle") / "head.pt"
    save_head(head, path)
    return target, head, str(path)


def make_llm(model, **kwargs):
    return LLM(model=model, tokenizer=CharTokenizer(), device="cpu", max_model_len=256, **kwargs)


def token_ids(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def greedy_workload(target, seed=0):
    """Prompts the target continues greedily: the head was trained on such text, so it agrees often."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(LENGTHS, target.cfg.vocab_size, seed=seed)]
    return prompts, [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]


def assert_drafts_were_verified(llm):
    spec = llm.engine.speculation
    assert spec.method == "eagle" and spec.drafted > 0 and 0 < spec.accepted <= spec.drafted
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks   # no leak


def test_greedy_equals_the_engine_without_speculation(setup):
    target, _, path = setup
    prompts, params = greedy_workload(target)
    expected = token_ids(make_llm(target), prompts, params)
    spec = make_llm(target, speculative_method="eagle", speculative_model=path, num_speculative_tokens=4,
                    speculative_policy="always")
    assert token_ids(spec, prompts, params) == expected
    assert_drafts_were_verified(spec)
    assert spec.engine.step_log[0]["num_seqs"] > 1                      # they really shared steps


def test_a_step_without_drafts_keeps_the_compiled_decode_step_and_still_feeds_the_head(setup):
    """The last token of a request has no room for drafts: a one-row step, which must take the compiled decode
    path (forward_with_features through it) and still hand its feature to the head."""
    target, _, path = setup
    prompts, params = greedy_workload(target)
    spec = make_llm(target, speculative_method="eagle", speculative_model=path, num_speculative_tokens=4,
                    speculative_policy="always")
    expected = token_ids(make_llm(target), prompts[2:3], params[2:3])
    assert token_ids(spec, prompts[2:3], params[2:3]) == expected
    assert spec.engine.runner.compiled_decode_steps >= 1 and spec.engine.speculation.accepted > 0


def test_greedy_equal_under_preemption_prefix_hits_and_a_tight_budget(setup):
    """16 blocks of 8 tokens force preemption (the head's cache is rebuilt from recomputed features); a shared
    48-token head hits the prefix cache (positions never computed: the head starts after them)."""
    target, _, path = setup
    head = random_prompts([48], target.cfg.vocab_size, seed=3)[0]
    prompts = [{"prompt_token_ids": head + t} for t in random_prompts([3, 9, 1, 20, 5], target.cfg.vocab_size, seed=4)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (30, 12, 25, 8, 40)]
    small = dict(block_size=8, num_kv_blocks=16, max_num_batched_tokens=48, max_model_len=120,
                 enable_prefix_caching=True)
    plain = LLM(model=target, tokenizer=CharTokenizer(), device="cpu", **small)
    expected = token_ids(plain, prompts, params)
    spec = LLM(model=target, tokenizer=CharTokenizer(), device="cpu", **small, speculative_method="eagle",
               speculative_model=path, num_speculative_tokens=5, speculative_policy="always")
    assert token_ids(spec, prompts, params) == expected
    assert_drafts_were_verified(spec)
    log = list(spec.engine.step_log)
    assert sum(s["num_preempted"] for s in log) > 0
    again = spec.generate(prompts[:2], params[:2], use_tqdm=False)     # again: now the prompts hit the cache
    assert [o.outputs[0].token_ids for o in again] == expected[:2]
    assert all(o.num_cached_tokens >= 48 for o in again)
    assert spec.engine.block_manager.num_free_blocks == spec.engine.block_manager.num_blocks


def test_the_incremental_cache_drafts_what_the_head_drafts_from_scratch(setup):
    """Features handed over in pieces (a prompt, then verified runs), drafts proposed between them: the same
    tokens as EagleHead.propose over the whole context at once."""
    target, head, _ = setup
    seq = random_prompts([10], 256, seed=7)[0]
    seq = seq + generate_greedy(target, [seq], 30)[0]
    feats = target_features(target, torch.tensor([seq]))[0]             # (L, dim)
    draft, end = EagleDraft(head), 10
    draft.add_features(0, feats[:end - 1])                              # the prompt's prefill: all but the last
    params = SamplingParams(temperature=0.0)
    for step in (1, 3, 1, 2, 4, 1):
        tokens, q = draft.propose(seq[:end], 4, params, None)
        assert q is None and tokens == head.propose(feats[:end - 1], seq[:end], 4)
        draft.add_features(end - 1, feats[end - 1:end - 1 + step])     # the pending token and accepted drafts
        end += step
    again, _ = draft.propose(seq[:end], 3, params, None)                # no new features: the saved prediction
    assert again == draft.propose(seq[:end], 3, params, None)[0] == head.propose(feats[:end - 1], seq[:end], 3)


def test_in_the_engine_the_head_runs_its_projections_by_the_few_row_kernel(setup):
    """On a CPU the engine lays the head's projections and draft LM head out in row blocks (use_blocked_linears): the
    predicted features and draft logits equal the plain head's up to summation order, and the drafts are the same."""
    from minillm.model import cpu_gemm

    target, head, path = setup
    if cpu_gemm.kernel()[0] is None:
        pytest.skip(f"no few-row kernel here: {cpu_gemm.kernel()[1]}")
    spec = make_llm(target, speculative_method="eagle", speculative_model=path, num_speculative_tokens=3)
    fast = spec.engine.speculation.head
    assert isinstance(fast.fc, cpu_gemm.BlockedLinearModule)
    assert isinstance(fast.block.ffn.w_down, cpu_gemm.BlockedLinearModule)
    assert fast.draft_lm is not None and head.draft_lm is None                    # the trained head is left as it was
    seq = random_prompts([20], 256, seed=9)[0]
    feats = target_features(target, torch.tensor([seq]))[0]                      # (L, dim)
    with torch.no_grad():
        want = head(feats[None], torch.tensor([seq[1:] + [seq[0]]]))             # (1, L, dim)
        got = fast(feats[None], torch.tensor([seq[1:] + [seq[0]]]))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(fast.draft_logits(got), head.draft_logits(want), atol=1e-3, rtol=1e-4)
    assert fast.propose(feats[:-1], seq, 4) == head.propose(feats[:-1], seq, 4)


def test_sampled_tokens_are_distributed_as_the_target():
    """T = 1 on a 16-token vocabulary with one EAGLE draft per step: the second token's distribution over 1500
    seeds must match the exact marginal p(x2) = sum_x1 p(x1) p(x2 | x1) computed from the model."""
    small = random_model(tiny_config(vocab_size=16, tie_embeddings=True), seed=1)
    head = trained_head(small, 16, 30)
    prompt = list(torch.randperm(16, generator=torch.Generator().manual_seed(0)).tolist())
    p2 = second_token_marginal(small, prompt)                           # (V,) the exact marginal
    with tempfile.TemporaryDirectory() as tmp:
        save_head(head, f"{tmp}/head.pt")
        spec = LLM(model=small, tokenizer=CharTokenizer(), device="cpu", max_model_len=64, max_num_seqs=256,
                   speculative_method="eagle", speculative_model=f"{tmp}/head.pt", num_speculative_tokens=1,
                   speculative_policy="always")
        n = 1500
        second = sampled_second_tokens(spec, prompt, n)
    stats = spec.engine.speculation
    assert stats.drafted >= n and 0 < stats.accepted < stats.drafted    # both branches ran
    assert chi2_pvalue(torch.bincount(second, minlength=16), p2.double()) > 0.001


def test_a_bf16_target_drafts_with_the_fp32_head(setup):
    """The head trained on the fp32 target runs in fp32 on a bf16 target's features (bf16 embedding rows included)."""
    target, _, path = setup
    low = copy.deepcopy(target).to(torch.bfloat16)
    prompts, params = greedy_workload(target)
    spec = make_llm(low, speculative_method="eagle", speculative_model=path, num_speculative_tokens=3,
                    speculative_policy="always")
    outs = token_ids(spec, prompts[:3], params[:3])
    assert [len(o) for o in outs] == MAX_TOKENS[:3] and spec.engine.speculation.accepted > 0


def test_bad_arguments_are_clear_errors(setup, tmp_path):
    target, _, _ = setup
    with pytest.raises(ValueError, match="there is none at"):
        make_llm(target, speculative_method="eagle", speculative_model=str(tmp_path / "missing.pt")).engine
    with pytest.raises(ValueError, match="only 'eagle' reads a file"):
        make_llm(target, speculative_method="ngram", speculative_model="head.pt")


TREE = [(0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0), (0, 1)]


def tree_llm(model, path, **kwargs):
    return make_llm(model, speculative_method="eagle", speculative_model=path, num_speculative_tokens=len(TREE),
                    speculative_token_tree=TREE, speculative_policy="always", **kwargs)


def test_tree_drafts_give_the_plain_greedy_tokens_one_request_at_a_time(setup, monkeypatch):
    """max_num_seqs=1: every decode step is a lone request's, so it verifies a tree of seven drafts in one small
    step; the tokens equal the engine's without speculation, and accepted paths that leave the first choice
    have their K/V moved (PagedKVCache.move_slots), else the later tokens would differ."""
    target, _, path = setup
    prompts, params = greedy_workload(target)
    expected = token_ids(make_llm(target), prompts, params)
    spec = tree_llm(target, path, max_num_seqs=1)
    moved = []
    original = spec.engine.kv.move_slots
    monkeypatch.setattr(spec.engine.kv, "move_slots", lambda src, dst: (moved.append(src), original(src, dst)))
    assert token_ids(spec, prompts, params) == expected
    assert_drafts_were_verified(spec)
    assert spec.engine.speculation.tree_verifications > 0 and moved


def test_tree_drafts_under_batching_fall_back_to_chains_with_the_plain_tokens(setup):
    """Several requests in a step: chains as deep as the tree; a lone request again: a tree. Same tokens."""
    target, _, path = setup
    prompts, params = greedy_workload(target)
    expected = token_ids(make_llm(target), prompts, params)
    spec = tree_llm(target, path)
    assert token_ids(spec, prompts, params) == expected
    stats = spec.engine.speculation
    assert stats.tree_verifications > 0 and stats.verify_runs > stats.tree_verifications
    assert_drafts_were_verified(spec)


def test_tree_drafts_keep_the_target_distribution_when_sampling():
    """T = 0.8, one request at a time, 16-token vocabulary: the second token is verified as a tree of the head's
    three best guesses (one step's multi-candidate rule in the engine); its distribution over 400 seeds must
    match the exact marginal from the model at that temperature."""
    small = random_model(tiny_config(vocab_size=16, tie_embeddings=True), seed=1)
    head = trained_head(small, 16, 30)
    prompt = list(torch.randperm(16, generator=torch.Generator().manual_seed(0)).tolist())
    p2 = second_token_marginal(small, prompt, temperature=0.8)
    tree = [(0,), (1,), (2,)]
    with tempfile.TemporaryDirectory() as tmp:
        save_head(head, f"{tmp}/head.pt")
        spec = LLM(model=small, tokenizer=CharTokenizer(), device="cpu", max_model_len=64, max_num_seqs=1,
                   speculative_method="eagle", speculative_model=f"{tmp}/head.pt", num_speculative_tokens=3,
                   speculative_token_tree=tree, speculative_policy="always")
        second = sampled_second_tokens(spec, prompt, 400, temperature=0.8)
    stats = spec.engine.speculation
    assert stats.tree_verifications >= 400 and 0 < stats.accepted < stats.drafted
    assert chi2_pvalue(torch.bincount(second, minlength=16), p2.double()) > 0.001


def test_bad_trees_are_clear_errors(setup):
    target, _, path = setup
    with pytest.raises(ValueError, match="only 'eagle' drafts trees"):
        make_llm(target, speculative_method="ngram", num_speculative_tokens=2, speculative_token_tree=[(0,), (1,)])
    with pytest.raises(ValueError, match="pass num_speculative_tokens=2"):
        make_llm(target, speculative_method="eagle", speculative_model=path, speculative_token_tree=[(0,), (1,)])
    with pytest.raises(ValueError, match=r"the parent of \(1, 0\)"):
        make_llm(target, speculative_method="eagle", speculative_model=path, num_speculative_tokens=2,
                 speculative_token_tree=[(0,), (1, 0)])
    with pytest.raises(ValueError, match="at most 7"):
        make_llm(target, speculative_method="eagle", speculative_model=path, num_speculative_tokens=8,
                 speculative_token_tree=[(i,) for i in range(8)])
    with pytest.raises(ValueError, match="not a list of tuples"):
        make_llm(target, speculative_method="eagle", speculative_model=path, speculative_token_tree="[(0,")
    llm = make_llm(target, speculative_method="eagle", speculative_model=path, num_speculative_tokens=2,
                   speculative_token_tree="[(1,), (0,)]")                  # vLLM's string form, any order
    assert llm.engine_config.speculative.token_tree == ((0,), (1,))
