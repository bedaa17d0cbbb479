"""bench engine-thread's plumbing on a tiny model: the "new thread" place really steps the engine on another thread,
the "loader thread" place on this one, both finish the same requests, and an error on the new thread reaches the
caller."""
import threading

import pytest

from minillm.course.benchmarks import engine_thread, serve_peers


def test_each_place_steps_the_engine_where_it_says(monkeypatch):
    from helpers import CharTokenizer
    from minillm import LLM
    from minillm.model.llama import random_model, tiny_config

    llm = LLM(model=random_model(tiny_config(), seed=0), tokenizer=CharTokenizer(), max_model_len=128)
    monkeypatch.setattr(serve_peers, "INPUT_LEN", 10)
    stepped_on, step = [], llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: (stepped_on.append(threading.current_thread()), step())[1])
    loader = engine_thread.measure(llm, 2, 4, 3, "loader thread")
    assert set(stepped_on) == {threading.current_thread()}
    stepped_on.clear()
    new = engine_thread.measure(llm, 2, 4, 3, "new thread")
    assert len(set(stepped_on)) == 1 and stepped_on[0] is not threading.current_thread()
    assert loader["completed"] == new["completed"] == 4 and new["os_threads_after"] >= 1


def test_an_error_on_the_new_thread_is_raised_to_the_caller():
    with pytest.raises(ZeroDivisionError):
        engine_thread.on_new_thread(lambda: 1 / 0)
