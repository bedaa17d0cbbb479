"""`python -m minillm bench prefix` (lesson 12): its workloads and its counters, on a tiny model."""
import pytest

from helpers import CharTokenizer
from minillm import LLM
from minillm.course.benchmarks import prefix as bp
from minillm.model.llama import random_model, tiny_config

class TextTokenizer(CharTokenizer):
    """CharTokenizer that can also encode: one id per character, never EOS."""

    def encode(self, text):
        return [3 + ord(c) % 90 for c in text]


TEXT = "paged attention stores keys and values in blocks; a radix tree shares prefixes. " * 12


def tiny_llm(mode):
    return LLM(model=random_model(tiny_config(), seed=0), tokenizer=TextTokenizer(), device="cpu",
               max_model_len=512, block_size=bp.BLOCK_SIZE, num_kv_blocks=256,
               enable_prefix_caching=mode != "none", prefix_cache="radix" if mode == "radix" else "hash")


@pytest.mark.parametrize("name", bp.WORKLOADS)
def test_each_workload_is_waves_of_prompts_that_share_a_prefix(name):
    waves = bp.WORKLOADS[name](TextTokenizer(), TEXT, quick=True)
    assert len(waves) >= 2 and all(waves)
    first = [p({k: [1] for k in [(c, t) for c in range(8) for t in range(8)]}) if callable(p) else p
             for p in waves[0]]
    assert all(len(p) > bp.BLOCK_SIZE for p in first)
    assert len({tuple(p[:bp.BLOCK_SIZE]) for p in first}) == 1           # one shared first block


def test_multi_turn_prompts_carry_the_earlier_answers():
    waves = bp.multi_turn(TextTokenizer(), TEXT, quick=True)
    turn1 = waves[1][0]({(0, 0): [7, 8, 9]})
    assert [7, 8, 9] == turn1[len(waves[0][0]({})):][:3]


def test_counters_add_up_and_caching_never_changes_tokens():
    waves = bp.branches(TextTokenizer(), TEXT, quick=True)
    runs = {mode: bp.run_workload(tiny_llm(mode), waves, max_tokens=4) for mode in bp.MODES}
    assert runs["none"]["outputs"] == runs["hash"]["outputs"] == runs["radix"]["outputs"]
    assert runs["none"]["cached_tokens"] == 0
    for r in runs.values():
        assert r["prefill_tokens_computed"] == r["prompt_tokens"] - r["cached_tokens"]   # no preemption here
        assert r["output_tokens"] == 4 * sum(len(w) for w in waves)
    assert runs["hash"]["cached_tokens"] == runs["radix"]["cached_tokens"] > 0
    assert runs["radix"]["peak_blocks_used"] < runs["hash"]["peak_blocks_used"]   # one copy of the document


def test_working_set_counts_whole_blocks_per_request():
    assert bp.working_set_blocks([[[0] * 20, [0] * 12]], max_tokens=4) == 2 + 1
