"""The serving runtime: engine, scheduler, KV cache, executor, models."""
