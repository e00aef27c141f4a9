"""The rollout engine: continuous batching over a paged KV cache with shared prompt prefixes."""
from marljax.sampling.engine.engine import Engine, EngineStats

__all__ = ["Engine", "EngineStats"]
