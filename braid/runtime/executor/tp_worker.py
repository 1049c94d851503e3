"""The processes of a tensor-parallel group: where each rank runs and how it joins.

Rank 0 is the scheduler process (`scheduler/process.py`), which joins with `join_group`; every
other rank runs `run_follower_process`: join, build the same `ModelRunner` over its shard, then
run the plans rank 0 sends (`plan.follow`) until told to stop. On one machine the engine starts
them all (`launch.spawn_runtime`); with `--nnodes N`, each other machine's `braid serve
--node-rank K` starts its own ranks with `spawn_followers` and waits on them.

A rank that dies takes the group down: its peers' next collective or plan fails at once (its
sockets close), rank 0 reports it to the front end and exits, and the followers exit when
rank 0 is gone (and with their parent, through the parent-death signal).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch

from braid._logging import configure_logging
from braid.runtime.config import EngineConfig
from braid.runtime.distributed.group import TPGroup, init_group
from braid.runtime.ipc.children import die_with_parent, runtime_process, start_children

logger = logging.getLogger(__name__)
# How long a rank that failed to start stays before it exits (see `run_follower`).
FAILED_RANK_LINGER_S = 5.0


def rank_config(config: EngineConfig, local_rank: int) -> EngineConfig:
    """The settings one rank runs with: on CUDA its own GPU (`cuda:<local rank>`)."""
    if config.torch_device.type == "cuda":
        return dataclasses.replace(config, device=f"cuda:{local_rank}")
    return config


def cpu_threads(config: EngineConfig) -> None:
    """On CPU, the machine's cores (or OMP_NUM_THREADS, where a data-parallel supervisor set
    it) split between its ranks: each forward runs on all of them at once."""
    if config.torch_device.type == "cpu":
        cores = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // config.ranks_per_node))


def join_group(config: EngineConfig, rank: int) -> tuple[EngineConfig, TPGroup]:
    """This process as rank `rank` of `config`'s group: its settings and its group."""
    local = rank % config.ranks_per_node
    config = rank_config(config, local)
    cpu_threads(config)
    group = init_group(rank, config.tp_size, local, config.dist_init_addr, config.torch_device)
    return config, group


def run_follower_process(
    config: EngineConfig, model_path: str, rank: int, parent_pid: int, log_level: str
) -> None:
    """Rank `rank` (> 0): build its shard of the model and run rank 0's plans."""
    from braid.runtime.distributed.plan import follow
    from braid.runtime.executor.model_runner import ModelRunner
    from braid.runtime.models.config import ModelConfig

    # A terminal's Ctrl-C reaches the whole group: rank 0's process stops this one.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent_pid)
    configure_logging(log_level)
    path = Path(model_path)
    try:
        config, group = join_group(config, rank)
        runner = ModelRunner(
            config,
            ModelConfig.from_dir(path),
            None if config.load_format == "dummy" else path,
            tp=group,
        )
    except Exception as e:  # rank 0 fails the same way and tells the front end
        logger.error("tensor-parallel rank %d failed to start: %s: %s", rank, type(e).__name__, e)
        # Stay a moment: a rank gone while rank 0 still forms the group leaves rank 0 a gloo
        # error to report (seen once, on a loaded machine) instead of this same reason.
        time.sleep(FAILED_RANK_LINGER_S)
        os._exit(1)
    try:
        follow(runner, group)
    except Exception as e:  # rank 0 gone (or this rank's forward failed): leave, loudly
        logger.error("tensor-parallel rank %d stops: %s: %s", rank, type(e).__name__, e)
        os._exit(1)
    group.destroy()
    # Leave without the interpreter's teardown: a thread the finished group left in C++ (gloo's
    # or the store client's) can still be joinable when the runtime's statics are destroyed,
    # which aborts the process (exit -6, "terminate called without an active exception"; once
    # in about thirty suite runs).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def follower_ranks(config: EngineConfig) -> list[int]:
    """The ranks this machine runs besides rank 0 (which the scheduler process is)."""
    per = config.ranks_per_node
    first = config.node_rank * per
    return [r for r in range(first, first + per) if r != 0]


def spawn_followers(
    config: EngineConfig, model_path: Path, log_level: str
) -> dict[str, BaseProcess]:
    """Start this machine's follower ranks (`runtime_process`); returns them by name."""
    procs = {
        f"tp-rank-{rank}": runtime_process(
            run_follower_process,
            (config, str(model_path), rank, os.getpid(), log_level),
            f"braid-tp-rank-{rank}",
        )
        for rank in follower_ranks(config)
    }
    start_children(procs.values())
    return procs


def serve_followers(config: EngineConfig, model_path: Path, log_level: str) -> int:
    """`braid serve --node-rank K` (K > 0): run this machine's ranks until they end; the exit
    status is 0 when rank 0 stopped them, else 1 (a rank died, or rank 0 did)."""
    procs = spawn_followers(config, model_path, log_level)
    logger.info(
        "node %d of %d: tensor-parallel ranks %s joining %s",
        config.node_rank,
        config.nnodes,
        ", ".join(n.removeprefix("tp-rank-") for n in procs),
        config.dist_init_addr,
    )
    try:
        while all(p.is_alive() for p in procs.values()):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    status = 0
    for name, p in procs.items():
        p.join(5.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
        if p.exitcode != 0:
            logger.error("node %d: %s exited with code %s", config.node_rank, name, p.exitcode)
            status = 1
    for p in procs.values():
        if p.is_alive():
            p.kill()
    return status
