"""Perplexity over non-overlapping token windows, and the project's evaluation text.

The text is Python's own documentation (`pydoc_data.topics`, shipped with every Python), so
every machine has it offline. Topics are split by name into two disjoint parts:
every 4th topic (sorted by name) is calibration data (GPTQ / AWQ statistics), the rest is
evaluation data. Some paragraphs are repeated across topics; the evaluation part drops any
paragraph that the calibration part contains, so nothing calibrates on text it is scored on.

Python's docs are one domain; a quantiser calibrated on some of them and scored on the rest is
judged in-domain only. DOMAINS adds English texts of other kinds, committed in minillm/data/
(sources and terms in its README.md), none of them ever used for calibration:

    domain_text("python-docs")    evaluation_text() (the default everywhere)
    domain_text("gpl-3")          the GNU GPL v3: FSF legal prose
    domain_text("apache-mpl")     the Apache License 2.0 and the Mozilla Public License 2.0
    domain_text("vim-charity")    Vim's uganda.txt: the Vim license and a charity's story
"""
from __future__ import annotations

import math
import re
from pathlib import Path

from minillm.engine.sampling import SamplingParams


def _paragraphs(calibration: bool) -> list[str]:
    from pydoc_data.topics import topics

    chosen = [text for i, (_, text) in enumerate(sorted(topics.items())) if (i % 4 == 0) == calibration]
    return [p.strip("\n") for text in chosen for p in re.split(r"\n\s*\n", text) if p.strip()]


def calibration_text() -> str:
    return "\n\n".join(_paragraphs(calibration=True))


def evaluation_text() -> str:
    seen = set(_paragraphs(calibration=True))
    return "\n\n".join(p for p in _paragraphs(calibration=False) if p not in seen)


DATA = Path(__file__).resolve().parent / "data"
# domain -> files in minillm/data joined by a blank line (None: evaluation_text())
_DOMAIN_FILES = {
    "python-docs": None,
    "gpl-3": ("gpl-3.txt",),
    "apache-mpl": ("apache-2.0.txt", "mpl-2.0.txt"),
    "vim-charity": ("vim-uganda.txt",),
}
DOMAINS = tuple(_DOMAIN_FILES)          # scoring domains, Python's docs first


def domain_text(name: str) -> str:
    """The evaluation text of one scoring domain (see DOMAINS); never calibration data."""
    if name not in _DOMAIN_FILES:
        raise ValueError(f"domain {name!r} is unknown; allowed: {', '.join(map(repr, DOMAINS))}")
    files = _DOMAIN_FILES[name]
    if files is None:
        return evaluation_text()
    return "\n\n".join((DATA / f).read_text(encoding="utf-8").strip("\n") for f in files)


def token_windows(token_ids: list[int], window: int, max_windows: int | None = None) -> list[list[int]]:
    """Non-overlapping windows of exactly `window` tokens (a shorter tail is dropped)."""
    if window < 2:
        raise ValueError(f"window = {window} is invalid; allowed: an integer >= 2")
    n = len(token_ids) // window
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise ValueError(f"text has {len(token_ids)} tokens, fewer than one window of {window}")
    return [token_ids[i * window:(i + 1) * window] for i in range(n)]


def window_nll(llm, windows: list[list[int]]) -> tuple[float, int]:
    """Summed negative log-likelihood and number of predicted tokens, through llm.generate's
    prompt_logprobs (so it measures whatever the engine runs: quantised, paged, ...)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    nll, count = 0.0, 0
    for out, w in zip(outs, windows):
        for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
            nll -= entry[w[pos]].logprob
            count += 1
    return nll, count


def perplexity(llm, text: str | None = None, window: int = 512, max_windows: int | None = None) -> float:
    """exp(mean NLL) of the evaluation text (or `text`) in non-overlapping windows."""
    ids = llm.get_tokenizer().encode(evaluation_text() if text is None else text)
    nll, count = window_nll(llm, token_windows(ids, window, max_windows))
    return math.exp(nll / count)
