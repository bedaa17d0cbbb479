"""Byte-level BPE tokenizer and chat template, built from a GGUF file's metadata.

GGUF stores the vocabulary (`tokenizer.ggml.tokens`), the merge list (`tokenizer.ggml.merges`),
the token types (3 = control tokens such as <|im_start|>), the special ids and a Jinja chat
template. The `tokenizers` library runs the BPE; what we add is the recipe:
  - pre-tokenizer `smollm` (SmolLM2's): digits split one by one, then GPT-2 byte-level rules;
  - control tokens are matched whole before BPE, so "<|im_end|>" is one id;
  - no BOS is prepended (`tokenizer.ggml.add_bos_token = False` for SmolLM2).
"""
from __future__ import annotations

import functools
import json
from datetime import datetime

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

CONTROL = 3  # llama.cpp token type for control tokens

SUPPORTED_PRE = ("smollm", "gpt2", "default", "qwen2", "llama-bpe")


class ChatTokenizer:
    """encode / decode / apply_chat_template, the small surface the rest of minillm needs."""

    def __init__(self, tokenizer: Tokenizer, bos_id: int | None, eos_id: int, add_bos: bool,
                 chat_template: str | None):
        self.tok = tokenizer
        self.bos_token_id = bos_id
        self.eos_token_id = eos_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use generate() with a plain prompt")
        _check_messages(messages)
        template = _compile_chat_template(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=self.decode([self.bos_token_id], False) if self.bos_token_id is not None else "",
                               eos_token=self.decode([self.eos_token_id], False))


@functools.lru_cache(maxsize=8)          # compiled once per template, not once per chat request
def _compile_chat_template(source: str):
    """The template comes from the model file, i.e. untrusted input: render it in jinja2's sandbox
    (no dunder attributes, no mutation of the passed objects) with the helpers transformers'
    apply_chat_template gives templates (raise_exception, strftime_now, tojson without HTML
    escaping, {% break %} / {% continue %}), so the same templates render the same."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"each message must be a dict with 'role' and 'content'; got {m!r}")
        if m["role"] not in ("system", "user", "assistant"):
            raise ValueError(f"message role must be 'system', 'user' or 'assistant'; got {m['role']!r}")


def tokenizer_from_gguf_metadata(meta: dict) -> ChatTokenizer:
    model_type = meta.get("tokenizer.ggml.model")
    if model_type != "gpt2":
        raise ValueError(f"tokenizer.ggml.model = {model_type!r} is not supported; supported: 'gpt2' (byte-level BPE)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in SUPPORTED_PRE:
        raise ValueError(f"tokenizer.ggml.pre = {pre!r} is not supported; supported: {', '.join(SUPPORTED_PRE)}")
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type", [])
    specials = [AddedToken(tokens[i], special=True, normalized=False)
                for i, t in enumerate(types) if t == CONTROL]
    tok.add_special_tokens(specials)
    return ChatTokenizer(
        tok,
        bos_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_id=meta["tokenizer.ggml.eos_token_id"],
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
    )
