"""minillm.perf.memory: the resident-set growth of one call (fresh process) and the bytes autograd saves."""
import sys

import pytest
import torch

from minillm.perf.memory import peak_rss_growth, saved_for_backward_bytes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")


def test_peak_rss_growth_sees_a_buffer_of_known_size():
    """A 64 MiB tensor written once raises the resident set by 64 MiB (page noise a few MiB); a statement that
    allocates nothing large does not."""
    big = peak_rss_growth("import torch", "torch.ones(16 * 2**20)", repeats=2)          # 16 Mi fp32 = 64 MiB
    small = peak_rss_growth("import torch", "torch.ones(16)")
    assert 60 * 2**20 <= big["peak_bytes"] <= 72 * 2**20, big
    assert small["peak_bytes"] < 4 * 2**20 and small["seconds"] is None
    assert big["seconds"] > 0


def test_peak_rss_growth_reports_the_childs_error():
    with pytest.raises(RuntimeError, match="NameError"):
        peak_rss_growth("", "undefined_name")
    with pytest.raises(ValueError, match="trials"):
        peak_rss_growth("", "1", trials=0)


def test_saved_for_backward_bytes_counts_what_a_matmul_keeps():
    """x @ w saves both operands for its backward; exp saves its output; a sum saves nothing."""
    x, w = torch.randn(32, 64, requires_grad=True), torch.randn(64, 16, requires_grad=True)
    assert saved_for_backward_bytes(lambda a, b: a @ b, x, w) == (32 * 64 + 64 * 16) * 4
    assert saved_for_backward_bytes(torch.exp, x) == 32 * 64 * 4
    assert saved_for_backward_bytes(torch.sum, x) == 0
