"""iterserve: an LLM serving engine built around iteration-level (continuous) batching."""

from typing import TYPE_CHECKING

from iterserve.config import EngineArgs
from iterserve.outputs import CompletionOutput, RequestMetrics, RequestOutput, StepStats
from iterserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # imported lazily below at run time (torch is heavy)
    from iterserve.engine import LLM, LLMEngine

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StepStats",
]


def __getattr__(name: str) -> object:
    # The engine pulls in torch; keep `import iterserve` (and iterserve.core) light.
    if name in ("LLM", "LLMEngine"):
        from iterserve import engine

        return getattr(engine, name)
    raise AttributeError(name)
