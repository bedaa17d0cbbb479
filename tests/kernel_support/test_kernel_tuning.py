"""minillm/kernel_support/tuning.py: each configuration timed once per key on CUDA, the fastest kept; the first
where nothing can be timed (off CUDA, during a CUDA graph capture)."""
import contextlib

import pytest
import torch

from minillm.kernel_support import tuning as kernel_tuning


def test_choose_config_times_each_candidate_once_per_key_and_keeps_the_fastest(monkeypatch):
    medians = {1: 3e-6, 2: 1e-6, 3: 2e-6}
    timed = []

    def fake_median_seconds(fn):
        timed.append(fn())
        return medians[timed[-1]]

    monkeypatch.setattr(kernel_tuning, "median_seconds", fake_median_seconds)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())   # no GPU here
    monkeypatch.setattr(kernel_tuning, "_chosen", {})
    configs = [{"c": 1}, {"c": 2}, {"c": 3}]
    run = lambda c: c["c"]                                                     # noqa: E731
    key = ("gemv", 1, 64, 64, "cuda:0")
    assert kernel_tuning.choose_config(key, configs, run) == {"c": 2}
    assert kernel_tuning.choose_config(key, configs, run) == {"c": 2} and timed == [1, 2, 3]   # remembered
    assert kernel_tuning.choose_config(key[:-1] + ("cpu",), configs, run) == {"c": 1}         # nothing timed
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert kernel_tuning.choose_config(key[:-1] + ("cuda:1",), configs, run) == {"c": 1}      # capturing
    assert timed == [1, 2, 3] and kernel_tuning.chosen_configs() == {"gemv 1 64 64 cuda:0": {"c": 2}}
    with pytest.raises(ValueError, match="no configuration"):
        kernel_tuning.choose_config(("x", "cpu"), [], run)


def test_length_bucket_is_the_next_power_of_two():
    assert [kernel_tuning.length_bucket(n) for n in (1, 2, 3, 4, 5, 1000, 1024, 1025)] == \
        [1, 2, 4, 4, 8, 1024, 1024, 2048]


def test_a_configuration_that_raises_is_skipped_and_reported(monkeypatch):
    """A tile that does not fit the GPU (Triton's OutOfResources) must not end a tuning: the others still run."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(kernel_tuning, "_chosen", {})
    monkeypatch.setattr(kernel_tuning, "_failed", {})
    monkeypatch.setattr(kernel_tuning, "median_seconds", lambda fn: fn())

    def run(c):
        if c["c"] == 1:
            raise RuntimeError("out of resources: shared memory")
        return c["c"] * 1e-6

    configs = [{"c": 1}, {"c": 3}, {"c": 2}]
    assert kernel_tuning.choose_config(("k", "cuda:0"), configs, run) == {"c": 2}
    assert kernel_tuning.failed_configs() == {"k cuda:0": [({"c": 1}, "RuntimeError: out of resources: shared memory")]}
    with pytest.raises(RuntimeError, match="out of resources"):
        kernel_tuning.choose_config(("all-fail", "cuda:0"), [{"c": 1}], run)
