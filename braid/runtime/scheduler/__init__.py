"""The scheduler: continuous batching over the KV pool. `scheduler.py` is the loop; batch
building and request state live beside it."""
