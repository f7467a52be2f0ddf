"""paged-serve's engine: `from engine import LLM, SamplingParams`."""

from engine.core.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams"]


def __getattr__(name: str):
    # Lazy, so that importing a light module (sampling_params) does not load the model stack.
    if name == "LLM":
        from engine.loop.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine.loop.llm_engine import LLMEngine

        return LLMEngine
    if name == "EngineArgs":
        from engine.loop.engine_args import EngineArgs

        return EngineArgs
    raise AttributeError(name)
