"""kvserve.engine: the inference engine (no gRPC in it).

``from kvserve.engine import LLM, SamplingParams``. The heavy names are imported lazily so
that the control plane (block manager, scheduler) can be used without importing torch.
"""

from kvserve.engine.config import EngineConfig
from kvserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from kvserve.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from kvserve.engine.core.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
