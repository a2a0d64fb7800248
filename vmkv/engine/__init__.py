"""Continuous-batching engine: scheduler, runner, sampler, ``LLMEngine`` and the offline ``LLM`` API.

Imports are lazy so that ``vmkv.engine.config`` and friends load without the model stack.
"""

from __future__ import annotations

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput",
           "EngineConfig", "CacheConfig", "SchedulerConfig", "EngineStats", "RequestMetrics",
           "PromptTooLongError", "RequestFailedError"]

_WHERE = {
    "LLM": "vmkv.engine.llm",
    "LLMEngine": "vmkv.engine.llm_engine",
    "SamplingParams": "vmkv.engine.sampling_params",
    "RequestOutputKind": "vmkv.engine.sampling_params",
    "RequestOutput": "vmkv.engine.outputs",
    "CompletionOutput": "vmkv.engine.outputs",
    "EngineStats": "vmkv.engine.outputs",
    "RequestMetrics": "vmkv.engine.outputs",
    "EngineConfig": "vmkv.engine.config",
    "CacheConfig": "vmkv.engine.config",
    "SchedulerConfig": "vmkv.engine.config",
    "PromptTooLongError": "vmkv.engine.sequence",
    "RequestFailedError": "vmkv.engine.errors",
}


def __getattr__(name: str):
    if name in _WHERE:
        import importlib  # noqa: PLC0415

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'vmkv.engine' has no attribute {name!r}")
