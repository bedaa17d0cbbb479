"""The public interface (vLLM's): outputs, logprobs, stop conditions, streaming, errors, CLI."""
import math
import subprocess
import sys

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.__main__ import main

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def test_generate_output_structure(llm):
    outs = llm.generate(["The capital of France is", {"prompt_token_ids": [504, 3575, 282]}], GREEDY,
                        use_tqdm=False)
    assert len(outs) == 2
    first = outs[0]
    assert first.prompt == "The capital of France is"
    assert first.prompt_token_ids == llm.get_tokenizer().encode(first.prompt)
    c = first.outputs[0]
    assert len(c.token_ids) == 8 and c.finish_reason == "length"
    assert c.text == llm.get_tokenizer().decode(c.token_ids)
    assert "Paris" in c.text
    m = first.metrics
    assert m.arrival_time <= m.first_token_time <= m.finished_time
    assert m.time_to_first_token > 0 and m.time_per_output_token > 0
    assert outs[1].prompt_token_ids == [504, 3575, 282]


def test_params_list_one_per_prompt_and_eos_stop(llm):
    prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "Say hi."}])
    outs = llm.generate([prompt, prompt], [SamplingParams(temperature=0, max_tokens=64),
                                           SamplingParams(temperature=0, max_tokens=3)], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "stop"          # ended by <|im_end|>
    assert outs[0].outputs[0].token_ids[-1] == llm.get_tokenizer().eos_token_id
    assert "<|im_end|>" not in outs[0].outputs[0].text
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 3
    assert outs[1].outputs[0].token_ids == outs[0].outputs[0].token_ids[:3]


def test_stop_string_truncates_and_streams_the_same_text(llm):
    params = SamplingParams(temperature=0, max_tokens=40, stop=["Paris"])
    out = llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "Paris" and "Paris" not in out.text
    streamed = "".join(llm.stream("The capital of France is", params))
    assert streamed == out.text


def test_prompt_logprobs_hold_the_actual_tokens(llm):
    ids = llm.get_tokenizer().encode("One, two, three, four, five")
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    with torch.no_grad():
        logp = llm.model(torch.tensor([ids]))[0].log_softmax(-1)
    # the engine's GEMM library is timed per weight shape at build: oneDNN's fp32 GEMM (chosen on the AMD
    # VM) sums in another order than F.linear's MKL, so the logprobs agree to fp32 rounding, not bit for bit
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert list(entry) == [ids[pos]]
        assert math.isclose(entry[ids[pos]].logprob, logp[pos - 1, ids[pos]].item(), abs_tol=1e-4)


def test_logprobs_of_generated_tokens(llm):
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4, logprobs=3), use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 4
    for tok, entry in zip(c.token_ids, c.logprobs):
        assert entry[tok].rank == 1 and len(entry) == 3     # greedy: the chosen token is the top one
    assert math.isclose(c.cumulative_logprob, sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))


def test_seeded_sampling_reproducible(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=12)
    a = llm.generate(["Once upon a time"], p, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate(["Once upon a time"], p, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b


def test_chat(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text


@pytest.mark.parametrize("prompts, match", [
    ([], "prompts is empty"),
    ([""], "prompt is empty"),
    ([{"prompt_token_ids": []}], "prompt is empty"),
    ([{"prompt_token_ids": [1, 99999999]}], "prompt_token_ids must be integers"),
    ([3.5], "a prompt must be"),
])
def test_bad_prompts(llm, prompts, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, GREEDY, use_tqdm=False)


def test_prompt_longer_than_context(llm):
    ids = list(range(3, 3 + llm.max_model_len))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)


def test_generation_stops_at_max_model_len(smollm2_path):
    small = LLM(model=str(smollm2_path), device="cpu", max_model_len=12)
    out = small.generate([{"prompt_token_ids": list(range(100, 110))}],
                         SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2 and out.outputs[0].finish_reason == "length"


def test_wrong_number_of_sampling_params(llm):
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)


@pytest.mark.parametrize("kwargs, match", [
    (dict(model="no-such-model"), "unknown model 'no-such-model'.*Accepted"),
    (dict(model="/no/such/file.gguf"), "unknown model"),
    (dict(dtype="float8"), "dtype 'float8' is not supported"),
    (dict(device="tpu"), "device"),
    (dict(max_model_len=0), "max_model_len"),
    (dict(max_model_len=100000), "exceeds the model's context"),
])
def test_bad_llm_arguments(smollm2_path, kwargs, match):
    kwargs.setdefault("model", str(smollm2_path))
    with pytest.raises(ValueError, match=match):
        LLM(**kwargs)


def test_model_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no config.json and \\*.safetensors"):
        LLM(model=str(tmp_path))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow                                       # the subprocess loads the real model
def test_cli_generate_streams_text():
    r = _cli("generate", "--max-tokens", "6", "--device", "cpu", "The capital of France is")
    assert r.returncode == 0 and "Paris" in r.stdout


@pytest.mark.parametrize("args, match", [
    (("generate", "--max-tokens", "0", "hi"), "max_tokens"),
    (("generate", "--temperature", "-1", "hi"), "temperature"),
    (("generate", "--model", "nope", "hi"), "unknown model"),
    (("bench", "no-such-bench"), "unknown benchmark"),
])
def test_cli_errors_are_one_line(args, match, capsys):
    """In this process: `python -m minillm` is sys.exit(main()), so main's return is the exit code."""
    assert main(list(args)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err and err.count("\n") == 1
