from iterserve.engine.llm import LLM
from iterserve.engine.llm_engine import LLMEngine

__all__ = ["LLM", "LLMEngine"]
