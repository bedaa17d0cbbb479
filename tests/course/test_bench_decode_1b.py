"""bench decode-1b's pieces on a tiny model: every system decodes the same weights (the 1B run itself is a
benchmark, not a test; its llama.cpp peer lives in a venv that `make test` never makes)."""
from __future__ import annotations

import dataclasses

import torch

from minillm import LLM
from minillm.course.benchmarks import decode_1b
from minillm.course.benchmarks.gpu_engine import IdsTokenizer, hf_twin
from minillm.loading.loader import load_model
from minillm.model.llama import random_model, tiny_config


def test_minillm_and_transformers_decode_the_same_tokens_from_the_same_weights(monkeypatch):
    monkeypatch.setattr(decode_1b, "NEW_TOKENS", 8)
    model = random_model(tiny_config(), seed=3)
    prompt = decode_1b.prompt_ids(model.cfg, 12)
    ours = decode_1b.minillm_decode(LLM(model=model, tokenizer=IdsTokenizer(), device="cpu", max_model_len=64), prompt)
    theirs = decode_1b.transformers_decode(hf_twin(model), prompt)
    assert ours["tokens"] == theirs["tokens"] and len(ours["tokens"]) == 8
    assert ours["decode_tok_s"] > 0 and theirs["decode_tok_s"] > 0


@torch.no_grad()
def test_the_gguf_written_for_llama_cpp_holds_the_same_weights(tmp_path):
    model = random_model(dataclasses.replace(tiny_config(), tie_embeddings=True), seed=4, dtype=torch.bfloat16)
    path = tmp_path / "tiny.gguf"
    decode_1b.write_gguf(model, path)
    loaded, _ = load_model(path, dtype="bfloat16", device="cpu")
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded(ids), model(ids))                          # bf16 bits written as they are


def test_engine_rows_reports_the_decode_only_step(monkeypatch):
    monkeypatch.setattr(decode_1b, "NEW_TOKENS", 8)
    llm = LLM(model=random_model(tiny_config(), seed=5), tokenizer=IdsTokenizer(), device="cpu", max_model_len=64)
    row = decode_1b.engine_rows(llm, decode_1b.prompt_ids(llm.config, 10), 4)
    assert row["rows"] == 4 and row["steps"] >= 2 and row["tok_s"] > 0
