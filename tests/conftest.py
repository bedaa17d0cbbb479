"""Shared fixtures. Real-model fixtures are session-scoped: SmolLM2 loads once per run.

The `slow` marker (pytest.ini) follows from the fixtures: a test that asks for the real model
or a peer library (SLOW_FIXTURES) is marked here, so the marker cannot drift from what a test
loads. A test that loads either without a fixture (a subprocess, a notebook, a peer imported at
module level) carries @pytest.mark.slow itself."""
from __future__ import annotations

import os

import torch

# Triton decides between compiling and interpreting when a kernel module is first imported:
# on a machine without CUDA every kernel test runs under the interpreter, whichever test file
# happens to import kernels/* first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

SLOW_FIXTURES = {"smollm2_path", "llm", "hf_model", "hf_tokenizer", "transformers", "bnb"}


SESSION_RECORDER = "minillm_session_outcomes"


def pytest_configure(config):
    """The lab grader's Recorder watches this run too, selecting everything: the labs' reference
    scores (test_labs.py) come from these outcomes instead of running the same tests again."""
    from minillm.course.labs.pytest_plugin import Recorder

    class SessionRecorder(Recorder):
        @pytest.hookimpl(tryfirst=True)             # every collected test, before -k or -m deselects any
        def pytest_collection_modifyitems(self, session, config, items):
            super().pytest_collection_modifyitems(session, config, items)

    config.pluginmanager.register(SessionRecorder(["*"]), SESSION_RECORDER)


COLLECT_AFTER_GROWTH = 1 << 30          # bytes of resident memory gained since the last collection
_resident_after_collect = [0]


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(autouse=True)
def collect_engines_left_in_cycles():
    """An engine sits in reference cycles (runner, backend, bound methods), so a test's engine, with its
    KV pool and weight copies, is freed only when Python's cycle collector runs, which it seldom does:
    the test process then held a dozen engines at once, and a full run was killed for memory when the
    notebooks' kernels started beside it. After any test that left the process COLLECT_AFTER_GROWTH
    larger than after the last collection, collect (Linux; elsewhere nothing)."""
    yield
    if not os.path.exists("/proc/self/statm"):
        return
    if _resident_bytes() - _resident_after_collect[0] > COLLECT_AFTER_GROWTH:
        import gc
        gc.collect()
        _resident_after_collect[0] = _resident_bytes()


@pytest.fixture
def fresh_compile_caches():
    """The test compiles afresh. Dynamo keeps what it learnt per function for the whole process: the
    sizes it saw change (made symbolic from then on: slower to compile and to run) and 8 recompiles
    per function, after which it runs the function eagerly, so a compiled-vs-eager test could compare
    eager with eager, or a "compiled" count include eager runs. Without this, a test inherits every earlier
    test's shapes and graphs. (Inductor's disk cache keeps the recompiles cheap.)"""
    torch._dynamo.reset()
    yield


def pytest_collection_modifyitems(items):
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.get_closest_marker("after_the_rest") is not None)   # stable: order kept


@pytest.fixture(scope="session")
def smollm2_path():
    from minillm.loading.loader import fetch_smollm2

    return fetch_smollm2()


@pytest.fixture(scope="session")
def llm(smollm2_path):
    """The real model through the public API, fp32 on CPU."""
    from minillm import LLM

    return LLM(model=str(smollm2_path), dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def transformers():
    """The peer library for models and tokenizers (skips where it is not installed)."""
    return pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def bnb():
    """bitsandbytes.functional: the peer for NF4 (skips where it is not installed)."""
    return pytest.importorskip("bitsandbytes.functional")


@pytest.fixture(scope="session")
def hf_model(smollm2_path, transformers):
    """transformers' LlamaForCausalLM loaded from the same GGUF: the peer for logits."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(smollm2_path, transformers):
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


@pytest.fixture
def tiny_model():
    from minillm.model.llama import random_model, tiny_config

    return random_model(tiny_config(), seed=0)
