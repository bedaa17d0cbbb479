"""bench redesign's arithmetic (the run itself needs two trees and ~20 minutes: results/redesign.json)."""
import pytest

from minillm.course.benchmarks import redesign


def row(side, speeds, tokens, measure="one_prompt", kind="bf16"):
    return {"kind": kind, "measure": measure, "side": side, "decode_tok_s": sorted(speeds)[len(speeds) // 2],
            "all_decode_tok_s": speeds, "ttft_s": 0.5, "tokens": tokens}


def test_a_speed_ratio_is_the_median_of_each_rounds_own_ratio():
    # after is 2% faster in every round but the third, which a slow spell hit on the after side only;
    # the medians of each side (20.4 against 30) would call that a third slower
    before = [30.0, 30.0, 30.0, 20.0, 20.0]
    after = [30.6, 30.6, 20.4, 20.4, 20.4]
    out = redesign.summarise([row("before", before, [1]), row("after", after, [1])])
    assert out["bf16_one_prompt_decode_tok_s_ratio"] == pytest.approx(1.02)
    assert out["bf16_one_prompt_tokens_identical"] and out["lowest_speed_ratio"] == pytest.approx(1.02)


class Before:
    def __init__(self, gap, spread):
        self.gap, self.spread, self.asked = gap, spread, []

    def ask(self, **cmd):
        self.asked.append(cmd)
        return {"top2_gap": self.gap, "logit_range": self.spread}


@pytest.mark.parametrize("gap, near", [(0.05, True), (0.5, False)])
def test_differing_tokens_are_checked_at_the_first_difference_against_the_near_tie_rule(gap, near):
    rows = [row("before", [1.0], [5, 6, 7, 8]), row("after", [1.0], [5, 6, 9, 8])]
    workers = {"before": Before(gap, spread=20.0), "after": None}
    found = redesign.first_difference(workers, "bf16", rows)
    assert workers["before"].asked == [{"op": "gap", "generated": [5, 6]}]
    assert found[0]["position"] == 2 and found[0]["near_tie"] is near
    out = redesign.summarise(rows + found)
    assert out["bf16_one_prompt_first_difference_near_tie"] is near and not out["bf16_one_prompt_tokens_identical"]
    assert redesign.first_difference(workers, "bf16", [rows[0], row("after", [1.0], [5, 6, 7, 8])]) == []
