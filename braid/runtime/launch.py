"""Starting one runtime's child processes: the scheduler and the detokenizer.

This module knows both process entry points, so that `tokenizer/` need not import
`scheduler/`: whoever builds a `TokenizerManager` (the offline engine, `braid serve`) hands it
`spawn=spawn_runtime`, and the manager calls it from `start()` once its sockets are bound. (A
manager built without `spawn` still imports this module itself, for callers not yet changed.)
"""

from __future__ import annotations

import dataclasses
import os
from multiprocessing.process import BaseProcess
from pathlib import Path

from braid.runtime.config import EngineConfig
from braid.runtime.ipc.children import runtime_process, start_children
from braid.runtime.ipc.sockets import Addresses, free_port


def use_braid_triton_cache() -> None:
    """Point Triton's kernel cache (`TRITON_CACHE_DIR`, unless the user set it) at braid's cache
    dir (`BRAID_CACHE_DIR`, else ~/.cache/braid), so that kernels compiled by one start (18 s
    of the first graph capture on an H200) are reused by the next; child processes inherit it."""
    if not os.environ.get("TRITON_CACHE_DIR"):
        from braid.runtime.models.source import cache_root

        os.environ["TRITON_CACHE_DIR"] = str(cache_root() / "triton")


# The processes' entry points, imported in the process itself: the scheduler's module pulls in
# torch and the model runner, which the caller (the server's front end, an `LLM`) then never
# imports just to name the target, so the runtime starts before the caller's heavy imports.
def _run_scheduler(*args) -> None:
    from braid.runtime.scheduler.process import run_scheduler_process

    run_scheduler_process(*args)


def _run_detokenizer(*args) -> None:
    from braid.runtime.tokenizer.detokenizer_process import run_detokenizer_process

    run_detokenizer_process(*args)


def spawn_runtime(
    config: EngineConfig,
    model_path: Path,
    eos_token_ids: frozenset[int],
    addrs: Addresses,
    log_level: str,
) -> dict[str, BaseProcess]:
    """Start the detokenizer and scheduler processes (`runtime_process`: daemonic, each exits
    when this process dies), talking on `addrs`; returns them, started, by name ("detokenizer",
    "scheduler"). With `tp_size` > 1 the scheduler is rank 0 of the tensor-parallel group and
    this machine's other ranks start too ("tp-rank-N"; `executor/tp_worker.py`), meeting at
    `dist_init_addr` or, on one machine, a free port here."""
    if config.tp_size > 1 and config.dist_init_addr is None:
        config = dataclasses.replace(config, dist_init_addr=f"127.0.0.1:{free_port()}")
    use_braid_triton_cache()
    pid = os.getpid()
    procs: dict[str, BaseProcess] = {
        "detokenizer": runtime_process(
            _run_detokenizer, (str(model_path), addrs, pid, log_level), "braid-detokenizer"
        ),
        "scheduler": runtime_process(
            _run_scheduler,
            (config, str(model_path), sorted(eos_token_ids), addrs, pid, log_level),
            "braid-scheduler",
        ),
    }
    start_children(procs.values())
    if config.tp_size > 1:
        from braid.runtime.executor.tp_worker import spawn_followers

        procs.update(spawn_followers(config, model_path, log_level))
    return procs
