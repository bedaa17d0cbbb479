"""minillm: LLM inference optimisation built from scratch, proven against a naive baseline.

The public names load on first use (PEP 562), so importing a part of the package that does not
need the engine (`python -m minillm lab list`, the kernels' minillm/kernel_support/args.py) does not
import torch and the whole engine with it.
"""
import importlib
from typing import TYPE_CHECKING

__all__ = ["LLM", "SamplingParams", "GuidedDecodingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"

_DEFINED_IN = {"LLM": ".llm", "SamplingParams": ".engine.sampling", "GuidedDecodingParams": ".engine.sampling",
               "RequestOutput": ".engine.outputs",
               "CompletionOutput": ".engine.outputs", "Logprob": ".engine.outputs"}

if TYPE_CHECKING:                      # for editors and type checkers; at run time __getattr__ imports them
    from .llm import LLM
    from .engine.outputs import CompletionOutput, Logprob, RequestOutput
    from .engine.sampling import GuidedDecodingParams, SamplingParams


def __getattr__(name: str):
    """Import a public name's module on first use and keep the name here (later lookups skip this)."""
    if name not in _DEFINED_IN:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_DEFINED_IN[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
