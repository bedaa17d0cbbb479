"""Incremental detokenising (OutputProcessor.detokenize): the text built a token at a time equals the whole output
decoded at once, for any token sequence (multi-byte characters split across tokens, invalid bytes, special tokens);
a stop string spanning tokens still stops; and each token costs a decode of a few tokens, not of the whole output."""
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm.engine.output_processor import OutputProcessor
from minillm.engine.request import Request
from minillm.engine.sampling import SamplingParams


def feed(tokenizer, ids, **params):
    """Append ids one by one as the engine would; -> the request, and the streamed deltas joined."""
    processor = OutputProcessor(tokenizer, max_model_len=100_000)
    req = Request.from_token_ids("r", [1])
    req.params = SamplingParams(max_tokens=len(ids), ignore_eos=True, **params)
    streamed = ""
    for token in ids:
        streamed += processor.append(req, None, token=token)          # the new visible text
        if req.finished:
            break
    return req, streamed


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_text_built_a_token_at_a_time_equals_the_whole_output_decoded(llm, data):
    tok = llm.get_tokenizer()
    text = data.draw(st.text(alphabet=st.sampled_from("ab 中文😀é\n.,<|>"), max_size=30))
    ids = tok.encode(text) + data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=8))   # stray bytes too
    if not ids:
        return
    req, streamed = feed(tok, ids)
    assert req.text == tok.decode(ids) == streamed


def test_a_stop_string_split_across_tokens_stops_and_is_cut(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("The answer is 42. STOP and more text after it")
    req, streamed = feed(tok, ids, stop=["STOP"])
    assert req.finish_reason == "stop" and req.stop_reason == "STOP"
    assert req.text == streamed == "The answer is 42. "
    assert len(req.output_token_ids) < len(ids)


def test_each_token_decodes_a_few_tokens_not_the_whole_output(llm, monkeypatch):
    tok = llm.get_tokenizer()
    ids = tok.encode("word " * 400 + "中文 😀 " * 50)
    lengths, decode = [], tok.decode
    monkeypatch.setattr(tok, "decode", lambda part, *a, **k: (lengths.append(len(part)), decode(part, *a, **k))[1])
    req, _ = feed(tok, ids)
    monkeypatch.undo()
    assert req.text == tok.decode(ids) and len(ids) > 500
    assert max(lengths) <= 8
