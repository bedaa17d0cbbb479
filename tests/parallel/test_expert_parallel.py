"""Expert parallelism (parallel/expert.py): a mixture of experts split by expert over 2 gloo ranks, each
with its own sequence (attention data-parallel, DeepSeek-V3's layout), tokens moved by all-to-all;
logits and greedy tokens equal to one process, bytes equal to what the routing sends."""
from __future__ import annotations

import pytest
import torch

from minillm.model.llama import random_model, tiny_config
from minillm.model.mla import MLAShape
from minillm.model.moe import MoE, MoEShape
from minillm.parallel.calculator import ep_bytes_per_token
from minillm.parallel.expert import ExpertParallelMoE, check_ep_size, owner, shard_experts
from minillm.parallel.launch import launch

WORLD, T, NEW = 2, 48, 6
CFG = tiny_config(n_layers=3, n_kv_heads=6, head_dim=8, mla=MLAShape(24, 32, 16, 8, 12),
                  moe=MoEShape(n_experts=8, top_k=2, expert_ffn_dim=32, router="sigmoid", n_shared=1, n_group=2,
                               topk_group=1, routed_scale=2.5, first_dense=1))


def sequences() -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (WORLD, T), generator=torch.Generator().manual_seed(4))


@torch.no_grad()
def greedy(model, ids: torch.Tensor, n: int) -> list[list[int]]:
    """n greedy tokens per row of ids (B, T), by the naive forward over the whole sequence each step."""
    for _ in range(n):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[:, -n:].tolist()


@torch.no_grad()
def _rank(rank: int, size: int) -> dict:
    from minillm.parallel import comm

    model = shard_experts(random_model(CFG, seed=1), rank, size)
    mine = sequences()[rank:rank + 1]                                   # (1, T): this rank's own request
    comm.reset_counts()
    logits = model(mine)
    sent = comm.COUNTS["all_to_all.bytes"]
    return dict(logits=logits.numpy(), bytes=sent, tokens=greedy(model, mine, NEW)[0],
                local_experts=[l.ffn.w_gate.shape[0] for l in model.layers if isinstance(l.ffn, ExpertParallelMoE)])


@pytest.fixture(scope="module")
def ranks():
    return launch(_rank, WORLD)


@torch.no_grad()
def test_each_ranks_logits_and_tokens_equal_one_process(ranks):
    model = random_model(CFG, seed=1)
    ids = sequences()
    want, tokens = model(ids), greedy(model, ids, NEW)
    for rank, got in enumerate(ranks):
        assert got["local_experts"] == [4, 4]                         # 8 experts, half on each rank, 2 MoE layers
        assert (torch.from_numpy(got["logits"])[0] - want[rank]).abs().max().item() < 1e-5 * want.abs().max().item()
        assert got["tokens"] == tokens[rank]


@torch.no_grad()
def test_bytes_sent_are_the_rows_that_cross_between_ranks(ranks):
    """Counted from the one-process routing: rank r dispatches each of its (token, expert) pairs whose expert
    lives elsewhere (dim floats each) and sends back, combined, each pair another rank routed to its experts;
    and near the even-routing formula."""
    model = random_model(CFG, seed=1)
    routed = []
    for layer in model.layers:
        if isinstance(layer.ffn, MoE):
            layer.ffn.register_forward_hook(lambda m, args, out: routed.append(m.routing(args[0].reshape(-1, 96))[1]))
    model(sequences())
    owners = [owner(experts, 8, WORLD).view(WORLD, T, -1) for experts in routed]    # per MoE layer (ranks, T, k)
    for rank, got in enumerate(ranks):
        away = sum(int((o[rank] != rank).sum()) for o in owners)
        arriving = sum(int((o[s] == rank).sum()) for o in owners for s in range(WORLD) if s != rank)
        assert got["bytes"] == (away + arriving) * CFG.dim * 4
        assert abs(got["bytes"] / (T * ep_bytes_per_token(CFG, WORLD, 4)) - 1) < 0.35


def test_a_size_that_does_not_split_the_experts_is_refused():
    with pytest.raises(ValueError, match="does not split 8 experts evenly; allowed: 1, 2, 4, 8"):
        check_ep_size(8, 3)
    with pytest.raises(ValueError, match="has none"):
        shard_experts(random_model(tiny_config()), 0, 2)



def test_a_dense_model_refuses_expert_parallelism_before_any_process_starts():
    from helpers import CharTokenizer
    from minillm import LLM

    with pytest.raises(ValueError, match="expert_parallel_size = 2: expert parallelism splits a mixture of experts"):
        LLM(model=random_model(tiny_config()), tokenizer=CharTokenizer(), device="cpu", max_model_len=64,
            expert_parallel_size=2)
