"""The engine: a torch-free scheduler, a model runner that owns the KV pool and the decode
graphs, and LLMEngine on top, under every command (generate, serve, eval, bench)."""
from .engine import DENSE_BELOW_KV_BYTES, EngineStats, LLMEngine, RequestOutput, resolve_device
from .sampling import TokenLogprob
from .scheduler import Request, SamplingParams, Scheduler, SchedulerFullError

__all__ = ["LLMEngine", "RequestOutput", "EngineStats", "SamplingParams", "Scheduler", "SchedulerFullError",
           "Request", "TokenLogprob", "resolve_device", "DENSE_BELOW_KV_BYTES"]
