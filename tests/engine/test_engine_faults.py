"""Faults and bad input (issue 17): refused early with a clear message, or cleaned up after.

Tiny random-weight model on CPU; the kernel checks run under TRITON_INTERPRET=1 where there is
no GPU (they fire on the host, before any launch).
"""
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import CharTokenizer, random_prompts  # noqa: E402
from minillm import LLM, SamplingParams  # noqa: E402
from minillm.attention.paged import paged_attention_split  # noqa: E402
from minillm.engine import engine as engine_module  # noqa: E402
from minillm.model.llama import random_model, tiny_config  # noqa: E402
from minillm.stages import fast_decode  # noqa: E402


def tiny_llm(max_model_len=128, num_kv_blocks=64, **kwargs):
    model = random_model(tiny_config(), seed=0)
    return LLM(model=model, tokenizer=CharTokenizer(), device="cpu", max_model_len=max_model_len,
               num_kv_blocks=num_kv_blocks, **kwargs)


def prompts_and_params(llm, lengths=(10, 20, 30), max_tokens=12):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(lengths, llm.config.vocab_size)]
    return prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


# ---- 1. without chunked prefill every sequence must fit one step ------------------------------

def test_no_chunking_needs_a_step_budget_of_max_model_len():
    # a preempted request recomputes prompt + output as ONE prefill: with a budget below
    # max_model_len it could never be re-admitted and would block the queue (vLLM refuses too)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens = 64 .*max_model_len = 128"):
        tiny_llm(enable_chunked_prefill=False, max_num_batched_tokens=64)
    tiny_llm(enable_chunked_prefill=False, max_num_batched_tokens=128)        # equal is enough
    tiny_llm(enable_chunked_prefill=True, max_num_batched_tokens=16)          # chunks: any budget


def test_prompt_over_the_step_budget_is_refused_when_added():
    llm = tiny_llm(enable_chunked_prefill=False, max_num_batched_tokens=128)
    llm.engine.scheduler.max_num_batched_tokens = 32        # the scheduler's own guard, engine args aside
    (req,) = llm.make_requests([{"prompt_token_ids": list(range(3, 43))}])
    with pytest.raises(ValueError, match="prompt has 40 tokens but max_num_batched_tokens is 32"):
        llm.engine.add_request(req)
    assert not llm.engine.has_unfinished() and not llm.engine.requests


# ---- 2. an error or Ctrl-C in generate leaves nothing behind -------------------------------------

def fail_at_step(monkeypatch, engine, step, exc):
    forward, calls = engine.runner.forward, []

    def flaky(batch):
        calls.append(1)
        if len(calls) == step:
            raise exc
        return forward(batch)
    monkeypatch.setattr(engine.runner, "forward", flaky)


@pytest.mark.parametrize("exc", [RuntimeError("injected"), KeyboardInterrupt()])
@pytest.mark.parametrize("step", [1, 4])
def test_failed_generate_frees_its_requests_and_blocks(monkeypatch, exc, step):
    llm = tiny_llm()
    prompts, params = prompts_and_params(llm)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    engine = llm.engine
    fail_at_step(monkeypatch, engine, step, exc)
    with pytest.raises(type(exc)):
        llm.generate(prompts, params, use_tqdm=False)
    assert engine.block_manager.num_free_blocks == engine.kv.num_blocks
    assert not engine.requests and not engine.has_unfinished()
    monkeypatch.undo()
    outs = llm.generate(prompts[:2], params, use_tqdm=False)    # only its own requests, same tokens
    assert [o.outputs[0].token_ids for o in outs] == want[:2]
    assert engine.block_manager.num_free_blocks == engine.kv.num_blocks


def test_failed_run_leaves_other_callers_requests_alone():
    llm = tiny_llm()
    engine = llm.engine
    prompts, params = prompts_and_params(llm)
    other, mine = llm.make_requests(prompts[:1], params), llm.make_requests(prompts[1:], params)
    engine.add_request(other[0])
    (dup,) = llm.make_requests(prompts[:1], params)
    dup.request_id = other[0].request_id                          # a clash: add_request refuses it
    with pytest.raises(ValueError, match="already in the engine"):
        engine.run(mine + [dup])
    assert list(engine.requests) == [other[0].request_id]        # mine aborted, the other still there
    engine.run([])
    assert other[0].finished and len(other[0].output_token_ids) == params.max_tokens


# ---- 3. the step log is bounded ----------------------------------------------------------------

def test_step_log_keeps_only_the_last_steps(monkeypatch):
    monkeypatch.setattr(engine_module, "STEP_LOG_LEN", 5)
    llm = tiny_llm()
    prompts, params = prompts_and_params(llm)
    llm.generate(prompts, params, use_tqdm=False)
    log = llm.engine.step_log
    assert len(log) == 5
    assert log[-1]["num_running"] == 0 and log[-1]["free_blocks"] == llm.engine.kv.num_blocks
    assert log[1:] == list(log)[1:] and log[0] is list(log)[0]        # readers slice it like a list
    assert [s["time"] for s in log] == sorted(s["time"] for s in log)


# ---- 4. sampling parameters: non-finite numbers and wrong types ------------------------------------

@pytest.mark.parametrize("name, value", [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", True),
    ("top_p", math.nan), ("top_p", math.inf),
    ("top_k", 2.0), ("top_k", True), ("max_tokens", 4.0), ("max_tokens", True),
    ("seed", 1.5), ("seed", True), ("logprobs", True),
])
def test_sampling_params_refuse_non_finite_and_wrong_types(name, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{name} = .* is invalid; allowed: "):
        SamplingParams(**{name: value})


# ---- 5. the GGUF chat template runs in a sandbox -------------------------------------------------

def chat_tokenizer(template):
    from tokenizers import Tokenizer, models

    from minillm.loading.tokenizer import ChatTokenizer
    return ChatTokenizer(Tokenizer(models.BPE()), bos_id=None, eos_id=0, add_bos=False, chat_template=template)


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.getcwd() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
])
def test_malicious_chat_template_is_refused(template):
    from jinja2.exceptions import SecurityError
    with pytest.raises(SecurityError):
        chat_tokenizer(template).apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_helpers_of_transformers():
    tok = chat_tokenizer("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                         "{{ m.content | tojson }}{% endfor %}"
                         "{% if messages | length > 2 %}{{ raise_exception('too many') }}{% endif %}")
    two = [{"role": "user", "content": "é<"}, {"role": "assistant", "content": "b"}]
    assert tok.apply_chat_template(two) == '"é<"'                 # loopcontrols; tojson not HTML-escaped
    from jinja2.exceptions import TemplateError
    with pytest.raises(TemplateError, match="too many"):
        tok.apply_chat_template(two + two[:1])


# ---- 6. only compiler failures switch compilation off --------------------------------------------

def _decoder():
    """Lesson 02's batch-1 decoder of a tiny fused model: it records a compiler failure on itself."""
    return fast_decode.FastDecoder(fast_decode.fuse_projections(random_model(tiny_config(), seed=0)))


def test_error_inside_compiled_step_propagates_and_compilation_stays_on():
    decoder = _decoder()

    def compiled(x):
        raise IndexError("a bug in the step, not the compiler")
    with pytest.raises(IndexError, match="not the compiler"):
        decoder._run(compiled, lambda x: x + 1, 1)
    assert decoder.compile_failed is None and decoder.gemv == "compiled"


def test_compiler_failure_falls_back_to_eager():
    decoder = _decoder()

    def compiled(x):
        raise torch._dynamo.exc.TorchRuntimeError("no C++ compiler")
    with pytest.warns(UserWarning, match="could not build"):
        assert decoder._run(compiled, lambda x: x + 1, 1) == 2
    assert "no C++ compiler" in decoder.compile_failed
    assert decoder._run(compiled, lambda x: x + 1, 1) == 2              # eager from then on, on this decoder
    assert _decoder().compile_failed is None                            # nothing process-wide remembers it


# ---- 7. kernel argument checks (on the host, before launching) -------------------------------------

def test_store_kv_refuses_slots_outside_the_cache():
    from kernels.paged_attention import store_kv
    device = "cuda" if torch.cuda.is_available() else "cpu"
    k_cache, v_cache = torch.zeros(2, 4, 2, 16, device=device), torch.zeros(2, 4, 2, 16, device=device)
    k = torch.ones(3, 2, 16, device=device)
    for slots in ([0, 8, 1], [0, -2, 1]):
        with pytest.raises(ValueError, match=r"slot_mapping .* \[-1, 8\)"):
            store_kv(k, k, k_cache, v_cache, torch.tensor(slots, device=device))
    assert k_cache.abs().sum() == 0                                    # nothing was written
    store_kv(k, k, k_cache, v_cache, torch.tensor([7, -1, 0], device=device))
    assert k_cache.flatten(0, 1).abs().sum((1, 2)).count_nonzero() == 2


def test_paged_decode_refuses_mismatched_or_unsupported_dtypes():
    from kernels.paged_attention import paged_attention_decode
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cache = torch.zeros(2, 4, 2, 16, device=device)
    tables, lens = torch.zeros(1, 2, dtype=torch.int32, device=device), torch.tensor([3], device=device)
    q = torch.zeros(1, 4, 16, device=device)
    with pytest.raises(ValueError, match="dtypes .* must agree"):
        paged_attention_decode(q.half(), cache, cache, tables, lens)
    with pytest.raises(ValueError, match="dtypes .* must agree"):
        paged_attention_decode(q, cache, cache.half(), tables, lens)
    with pytest.raises(ValueError, match="int8 is not supported; allowed: "):
        paged_attention_decode(q.to(torch.int8), cache.to(torch.int8), cache.to(torch.int8), tables, lens)


def test_paged_attention_split_allocates_on_the_inputs_device():
    # meta tensors have a device but no data: any CPU scratch tensor would clash with them
    q, cache = torch.empty(1, 4, 16, device="meta"), torch.empty(2, 4, 2, 16, device="meta")
    tables, lens = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([6])
    out = paged_attention_split(q, cache, cache, tables, lens, 0.25, num_splits=2, tile=4)
    assert out.device.type == "meta" and out.shape == q.shape
