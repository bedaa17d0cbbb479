"""Our tokenizer (built from GGUF metadata) gives transformers' ids for the same GGUF."""
import pytest

CASES = [
    "",
    "Hello, world!",
    "  leading spaces,   runs   of spaces\n\n\n\ttabs\r\nand CRLF  ",
    "Numbers: 12345, 3.14159, -0.5e10, 2026-11-29, 1,000,000",
    "ünïcödé — “quotes” 日本語のテキスト 中文 한국어 🤖🚀 emoji",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # recursion\n",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "don't won't I'll we've they're it's",
    "<|endoftext|> text after a special token <|im_end|>",
    "a" * 300,
]


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.get_tokenizer()


@pytest.mark.parametrize("text", CASES, ids=range(len(CASES)))
def test_ids_match_transformers(tokenizer, hf_tokenizer, text):
    assert tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", CASES[1:6], ids=range(5))
def test_decode_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_tokens_are_single_ids(tokenizer):
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("<|im_end|>") == [tokenizer.eos_token_id] == [2]


def test_chat_template_matches_transformers(tokenizer, hf_tokenizer):
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
    ]
    for messages in conversations:
        ours = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ref = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours == ref


@pytest.mark.parametrize("messages", [[], "hi", [{"role": "robot", "content": "x"}], [{"content": "x"}]])
def test_bad_messages_are_clear_errors(tokenizer, messages):
    with pytest.raises(ValueError, match="message|messages"):
        tokenizer.apply_chat_template(messages)
