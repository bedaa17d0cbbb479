"""The EAGLE draft head (speculative/eagle.py): it predicts the target's next feature from its current one and
the next token, learns that from the target's own text, drafts k tokens on its own predictions, and saves and
loads for the same target only."""
from __future__ import annotations

import pytest
import torch

from minillm.model.llama import random_model, tiny_config
from minillm.speculative.eagle import (EagleHead, HeadConfig, draft_vocabulary, load_head, save_head,
                                       target_features, train_head)
from minillm.stages.kv_cache import generate_greedy


@pytest.fixture(scope="module")
def trained():
    target = random_model(tiny_config(tie_embeddings=True), seed=0)
    prompts = [torch.randint(0, 256, (6,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(24)]
    sequences = [p + out for p, out in zip(prompts, generate_greedy(target, prompts, 40))]
    head, curve = train_head(target, sequences, HeadConfig(draft_vocab=128, steps=80, batch=4, seq_len=32, lr=3e-3))
    return target, sequences, head, curve


def test_features_are_what_the_lm_head_reads(trained):
    target, sequences, _, _ = trained
    ids = torch.tensor([sequences[0]])
    assert torch.allclose(target_features(target, ids) @ target.embed.weight.t(), target(ids), atol=1e-4)


def test_training_lowers_the_losses_and_raises_agreement(trained):
    *_, curve = trained
    first, last = curve[0], curve[-1]
    assert last["reg_loss"] < first["reg_loss"] and last["cls_loss"] < first["cls_loss"]
    assert last["top1_next_token"] > first["top1_next_token"]


def test_the_head_drafts_k_tokens_from_the_draft_vocabulary_and_agrees_with_the_target_sometimes(trained):
    target, sequences, head, _ = trained
    agree = 0
    for seq in sequences[:8]:
        ids = seq[:20]
        feats = target_features(target, torch.tensor([ids]))[0]
        drafts = head.propose(feats[:-1], ids, 3)
        assert len(drafts) == 3 and all(d in head.vocab.tolist() for d in drafts)
        agree += int(drafts[0] == seq[20])
    assert agree >= 2                                     # the target's own next token, from its features


def test_the_draft_vocabulary_is_the_most_frequent_tokens():
    vocab, coverage = draft_vocabulary([[1, 1, 1, 2, 2, 3]], 2, 10)
    assert vocab.tolist() == [1, 2] and coverage == pytest.approx(5 / 6)


def test_a_saved_head_loads_for_its_target_only(trained, tmp_path):
    target, sequences, head, _ = trained
    save_head(head, tmp_path / "head.pt")
    again = load_head(target, tmp_path / "head.pt")
    feats = target_features(target, torch.tensor([sequences[1][:12]]))[0]
    assert again.propose(feats[:-1], sequences[1][:12], 4) == head.propose(feats[:-1], sequences[1][:12], 4)
    with pytest.raises(ValueError, match="trained for another model shape"):
        load_head(random_model(tiny_config(tie_embeddings=True, n_layers=3)), tmp_path / "head.pt")
    with pytest.raises(ValueError, match="untied head"):
        EagleHead(random_model(tiny_config(tie_embeddings=False)), torch.arange(8))
