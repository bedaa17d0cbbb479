"""Perplexity: our fp32 number equals transformers' on the same windows within 0.1%."""
import math
import re

import pytest
import torch
import torch.nn.functional as F

from minillm.evaluate import calibration_text, evaluation_text, perplexity, token_windows


def test_calibration_and_evaluation_are_disjoint_and_substantial():
    cal, ev = calibration_text(), evaluation_text()
    assert len(cal) > 50_000 and len(ev) > 200_000
    cal_parts, ev_parts = set(re.split(r"\n\s*\n", cal)), set(re.split(r"\n\s*\n", ev))
    shared = {p for p in cal_parts & ev_parts if len(p) > 200}
    assert not shared                      # no long paragraph appears in both


def test_windows_do_not_overlap():
    ws = token_windows(list(range(1000)), 300)
    assert [w[0] for w in ws] == [0, 300, 600] and all(len(w) == 300 for w in ws)
    with pytest.raises(ValueError, match="window"):
        token_windows(list(range(10)), 1)
    with pytest.raises(ValueError, match="fewer than one window"):
        token_windows(list(range(10)), 20)


@torch.no_grad()
def test_perplexity_matches_transformers(llm, hf_model):
    window, n = 256, 3
    ours = perplexity(llm, window=window, max_windows=n)
    ids = llm.get_tokenizer().encode(evaluation_text())
    nll, count = 0.0, 0
    for w in token_windows(ids, window, n):
        x = torch.tensor([w])
        logits = hf_model(x).logits[0, :-1]
        nll += F.cross_entropy(logits.float(), x[0, 1:], reduction="sum").item()
        count += window - 1
    ref = math.exp(nll / count)
    assert 1.5 < ours < 100                 # a real language model on English prose
    assert abs(ours / ref - 1) < 1e-3
