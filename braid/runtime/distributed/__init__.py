"""Tensor parallelism's communication: the process group of a model's ranks (`group.py`) and
the plan rank 0 sends the others with every forward (`plan.py`). The parallel layers are
`braid.runtime.layers.parallel`; the ranks' processes, `braid.runtime.executor.tp_worker`."""
