"""minillm: LLM inference optimisation built from scratch, proven against a naive baseline."""
from .llm import LLM
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
