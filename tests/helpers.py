"""Small shared pieces for tests (import as `from helpers import ...`; tests/ is on sys.path)."""
import torch


class CharTokenizer:
    """Just enough tokenizer for the tiny random model: id -> one printable character."""
    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(33 + i % 90) for i in ids if not (skip_special_tokens and i == self.eos_token_id))


def random_prompts(lengths, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
