"""make demo: dtype "auto" chats in the dtype it timed faster here."""
import pytest

from minillm.course import demo


@pytest.mark.parametrize("speeds, want", [({"float32": 30.0, "bfloat16": 45.0}, "bfloat16"),
                                          ({"float32": 60.0, "bfloat16": 50.0}, "float32")])
def test_auto_picks_the_dtype_that_decoded_faster(monkeypatch, capsys, speeds, want):
    loaded = []
    monkeypatch.setattr(demo, "load_warm", lambda model, dtype: loaded.append(dtype) or f"llm-{dtype}")
    monkeypatch.setattr(demo, "decode_tok_s", lambda llm: speeds[llm.removeprefix("llm-")])
    dtype, llm = demo.faster_dtype("smollm2")
    assert (dtype, llm) == (want, f"llm-{want}")
    assert loaded == list(demo.AUTO_DTYPES)
    assert f"chatting in {want}" in capsys.readouterr().out

