"""The scheduler process: owns the model and the KV cache; receive, schedule, run, send."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import zmq

from braid._logging import configure_logging
from braid.runtime.config import EngineConfig
from braid.runtime.constrained.compile_pool import AsyncGrammarCompiler
from braid.runtime.constrained.grammar import GrammarCompiler
from braid.runtime.distributed.group import TPGroup
from braid.runtime.errors import error_param
from braid.runtime.executor.model_runner import ModelRunner
from braid.runtime.executor.profiler import PROFILER
from braid.runtime.executor.tp_worker import join_group
from braid.runtime.ipc import codec
from braid.runtime.ipc.children import die_with_parent, parent_alive
from braid.runtime.ipc.sockets import (
    Addresses,
    freeze_startup_heap,
    release_free_heap,
    send,
    since_process_start,
)
from braid.runtime.ipc.to_detokenizer import BatchTokenOut, Refusal, TokenOut
from braid.runtime.ipc.to_scheduler import (
    AbortReq,
    ControlReq,
    GenerateBatch,
    GenerateReq,
    ShutdownReq,
)
from braid.runtime.ipc.to_tokenizer import (
    ControlOut,
    ProcessFailed,
    ProgramInfo,
    SchedulerHeartbeat,
    SchedulerReady,
)
from braid.runtime.models.config import ModelConfig
from braid.runtime.scheduler.scheduler import Scheduler
from braid.runtime.tokenizer.tokenizer import has_tokenizer, load_vocabulary

logger = logging.getLogger(__name__)

# An idle loop waits this long for a message; after one such wait it gives freed heap back.
IDLE_POLL_MS = 500


# The scheduler process's GIL switch interval (CPython's default: 5 ms).
GIL_SLICE_S = 0.0005


def build_scheduler(
    config: EngineConfig,
    model_path: Path,
    eos_token_ids: frozenset[int],
    tp: TPGroup | None = None,
) -> Scheduler:
    """Load the model and build the scheduler over it (in whatever process calls this); `tp`:
    this process is rank 0 of that tensor-parallel group."""
    model_config = ModelConfig.from_dir(model_path)
    backend = config.effective_grammar_backend
    prepared = None
    if config.torch_device.type == "cuda" and has_tokenizer(model_path):
        # On a GPU the grammar compiler is built during the load, so constraints are ready at
        # start: the vocabulary (`load_vocabulary`: tokenizer.json read without transformers
        # where it can be) and the default backend's view of it (xgrammar's import brings
        # transformers': seconds of Python, which beside a serving scheduler made the first
        # constrained request take 9.4 s on the H200 machine). It runs beside the weights'
        # load and the graphs' capture, and is waited for after them (the ready line's
        # "grammar"): on the H200 machine, with a fresh machine's kernel compiles, the wait was
        # 0.00 s and ready came 0.7-2.1 s sooner than with the capture waiting for it (0.75-0.77
        # s), and a second start's capture took 1.42 s beside it (1.2-1.5 s after it). The
        # compile pool's workers start at once and import their library meanwhile, in their
        # own processes (xgrammar's took 3-4 s there).
        prepared = concurrent.futures.ThreadPoolExecutor(1, "braid-grammar").submit(
            prepare_grammar_compiler, model_path, backend
        )

    def grammar_compiler():
        if prepared is not None:
            return prepared.result()
        return GrammarCompiler(load_vocabulary(model_path), backend)

    pool = None
    if has_tokenizer(model_path):
        pool = AsyncGrammarCompiler(grammar_compiler, backend=backend)
        if prepared is not None:
            pool.start()

    capture, aux = False, ()
    if config.speculative_algorithm is not None:
        from braid.runtime.speculative import PROPOSERS

        proposer = PROPOSERS.get(config.speculative_algorithm)
        capture, aux = proposer.target_capture(config, model_config)
    try:
        runner = ModelRunner(
            config,
            model_config,
            None if config.load_format == "dummy" else model_path,
            capture_hidden=capture,
            aux_layers=aux,
            tp=tp,
        )
    except BaseException:
        if pool is not None:  # its workers started with the load (an in-process caller lives on)
            pool.shutdown(0)
        raise
    if prepared is not None:
        mark = time.perf_counter()
        concurrent.futures.wait([prepared])
        runner.phases["grammar"] = time.perf_counter() - mark
        if prepared.exception() is not None:  # the first constrained request fails with it too
            e = prepared.exception()
            logger.warning("the grammar compiler did not build: %s: %s", type(e).__name__, e)
    return Scheduler(
        runner,
        config,
        eos_token_ids=eos_token_ids,
        grammar_compiler=pool,
    )


def prepare_grammar_compiler(model_path: Path, backend: str) -> GrammarCompiler:
    """The grammar compiler over the vocabulary of `model_path`'s tokenizer, with `backend`
    built (its library imported); a backend that fails to build is left for the first compile
    to report (or fall back from)."""
    compiler = GrammarCompiler(load_vocabulary(model_path), backend)
    try:
        compiler.get_backend(backend)
    except Exception as e:  # reported again to the first constrained request
        logger.warning("grammar backend %s did not build: %s: %s", backend, type(e).__name__, e)
    return compiler


class ThroughputLog:
    """One INFO line every `every_s` seconds while the scheduler works (SGLang's decode-batch
    line, vLLM's throughput line): the requests running and queued, the KV pool's use, and the
    prefill and generation rates since the line before. None: off (the offline `LLM`, as
    vLLM's; `braid serve` turns it on with the control op "log_throughput")."""

    def __init__(self, every_s: float | None = None) -> None:
        self.every_s = every_s
        self.idle()

    def idle(self) -> None:
        """Nothing runs: the next line counts from when work comes again."""
        self.generated, self.prefilled_at, self.since = 0, None, None

    def begin(self, s: Scheduler) -> None:
        """A step starts: after idling, the next line counts from here."""
        if self.since is None:
            self.prefilled_at, self.since = s.stats.prefill_tokens_computed, time.monotonic()

    def note(self, s: Scheduler, outs: list[TokenOut]) -> None:
        """A step's outputs: the line, if `every_s` has passed since the last."""
        if self.every_s is None:
            return
        self.generated += sum(len(o.new_token_ids) for o in outs)
        seconds = time.monotonic() - self.since
        if seconds < self.every_s or seconds <= 0:
            return
        stats = s.control("stats", None)
        prefilled = s.stats.prefill_tokens_computed
        logger.info(
            "%d running, %d queued; KV %.1f%% used; last %.0f s: prefill %.1f tok/s, "
            "generation %.1f tok/s",
            stats["running_requests"],
            stats["queued_requests"],
            100 * stats["kv_usage"],
            seconds,
            (prefilled - self.prefilled_at) / seconds,
            self.generated / seconds,
        )
        self.generated, self.prefilled_at, self.since = 0, prefilled, time.monotonic()


class SchedulerLoop:
    """One iteration's logic, free of sockets: messages in, messages out."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.throughput = ThroughputLog()
        self.stopping = False
        # Under tensor parallelism a failed step is the group's end: the other ranks may be
        # waiting in a collective rank 0 never reached, so it is raised, not survived.
        self.failures_are_fatal = scheduler.runner.tp is not None

    def handle(self, msg: object) -> list[object]:
        s = self.scheduler
        if isinstance(msg, GenerateBatch):
            return [out for req in msg.reqs for out in self.handle(req)]
        if isinstance(msg, GenerateReq):
            try:
                s.handle(msg)
            except ValueError as e:
                # The front end validates first; this is the last line of defence.
                failed = TokenOut(
                    msg.rid,
                    [],
                    len(msg.input_ids),
                    0,
                    "abort",
                    error=str(e),
                    refused=Refusal(error_param(e)),
                )
                return [BatchTokenOut([failed])]
            return []
        if isinstance(msg, AbortReq):
            outs = s.handle(msg)
            return [BatchTokenOut(outs)] if outs else []
        if isinstance(msg, ControlReq):
            if msg.op in ("start_profile", "stop_profile"):
                return [self.profile(msg)]
            if msg.op == "log_throughput":
                self.throughput.every_s = float(msg.arg) if msg.arg else None
                return [ControlOut(msg.req_id, True)]
            try:
                result = s.control(msg.op, msg.arg)
                programs = s.program_infos() if msg.op == "stats" else None
                return [ControlOut(msg.req_id, True, result, programs=programs)]
            except (ValueError, AssertionError) as e:
                return [ControlOut(msg.req_id, False, {}, f"{type(e).__name__}: {e}")]
        if isinstance(msg, ShutdownReq):
            self.request_stop()
            return []
        logger.warning("scheduler ignores a %s message", type(msg).__name__)
        return []

    def profile(self, msg: ControlReq) -> ControlOut:
        """Start the torch profiler (`msg.arg`: the output directory, None for the
        environment's) or stop it; a stop's answer lists the files written in `detail`."""
        try:
            if msg.op == "start_profile":
                PROFILER.start(msg.arg)
                return ControlOut(msg.req_id, True)
            forwards = PROFILER.forwards
            files = PROFILER.stop()
            return ControlOut(msg.req_id, True, {"forwards": float(forwards)}, detail=files)
        except ValueError as e:
            return ControlOut(msg.req_id, False, {}, f"ValueError: {e}")

    def request_stop(self) -> None:
        """End the loop after the current iteration."""
        self.stopping = True

    def step(self) -> list[object]:
        """Run one step. A step that raises (a kernel error, out of memory) fails the requests
        in flight with that error; the scheduler keeps serving."""
        s = self.scheduler
        if not s.has_work:
            s.expire()  # session pins reach their TTL while nothing runs too
            self.throughput.idle()
            return []
        self.throughput.begin(s)
        try:
            outs = s.step()
        except Exception as e:  # any failure of a forward must not kill the server
            if self.failures_are_fatal:
                raise
            logger.error("step failed, failing the requests in flight: %s", e)
            logger.debug("%s", traceback.format_exc())
            outs = s.fail_all(f"internal error: {e}")
        self.throughput.note(s, outs)
        return [BatchTokenOut(outs)] if outs else []


def run_scheduler_process(
    config: EngineConfig,
    model_path: str,
    eos_token_ids: list[int],
    addrs: Addresses,
    parent_pid: int,
    log_level: str,
) -> None:
    # Start-up phases for the ready line: the process's start (interpreter, torch and braid's
    # imports), joining the tensor-parallel group, the model runner's (weights, KV cache,
    # graphs) and the rest of building the scheduler.
    started = since_process_start()
    phases = {"process start": started} if started is not None else {}
    # A terminal's Ctrl-C reaches the whole process group: the server stops this process
    # (ShutdownReq, then SIGTERM), so a KeyboardInterrupt here would only print a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent_pid)
    configure_logging(log_level)
    # Short GIL slices: this thread launches kernels, each launch releasing the GIL, while
    # other threads run Python (grammar compiles, the tokenizer's load during the weights').
    # At CPython's 5 ms default every launch could wait a whole slice to get it back
    # (benchmarks/gil_slices.py: a loop of short GIL-releasing calls beside a busy thread ran
    # 3-54x slower than alone at 5 ms, ~2.2x at 0.5 ms).
    sys.setswitchinterval(GIL_SLICE_S)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(addrs.scheduler)
    out = ctx.socket(zmq.PUSH)
    out.connect(addrs.detokenizer)
    t0 = time.perf_counter()
    tp = None
    try:
        if config.tp_size > 1:
            config, tp = join_group(config, 0)
            phases["group"] = time.perf_counter() - t0
        scheduler = build_scheduler(config, Path(model_path), frozenset(eos_token_ids), tp)
    except Exception as e:  # report any start-up failure to the front end, then exit
        send(out, ProcessFailed("scheduler", f"{type(e).__name__}: {e}"))
        time.sleep(0.5)
        if tp is not None:
            os._exit(1)  # the other ranks notice, and leave too
        return
    runner = scheduler.runner
    load_time = time.perf_counter() - t0
    phases.update(runner.phases)
    phases["rest"] = load_time - sum(v for k, v in phases.items() if k != "process start")
    loop = SchedulerLoop(scheduler)
    # SIGTERM (the front end's second request to stop, after the ShutdownReq) ends the loop
    # where a ShutdownReq would: under tensor parallelism the other ranks are then told to stop
    # rather than finding rank 0 gone (a follower node once exited 1 at shutdown on a loaded
    # machine, where the scheduler took longer than the front end waits before SIGTERM).
    signal.signal(signal.SIGTERM, lambda signum, frame: loop.request_stop())
    send(
        out,
        SchedulerReady(
            context_length=runner.context_length,
            kv_capacity_tokens=runner.kv_pool.allocator.capacity_tokens,
            max_running_requests=runner.max_running_requests,
            vocab_size=runner.model_config.vocab_size,
            eos_token_ids=sorted(eos_token_ids),
            device=str(runner.device),
            dtype=str(runner.dtype).removeprefix("torch."),
            load_time_s=load_time,
            phases=phases,
        ),
    )
    freeze_startup_heap()
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    beat = Heartbeat(ctx, addrs.tokenizer, scheduler)
    beat.start()
    worked = False  # since the heap was last given back
    plans = runner.plans  # tensor parallelism: rank 0's line to the other ranks
    graphs = runner.graph_runner
    try:
        while not loop.stopping:
            beat.loop_iterated()
            busy = scheduler.has_work
            worked = worked or busy
            replies: list[object] = []
            # Decode graphs left for idle time: one capture per idle iteration, so a message
            # that arrives waits for one capture at most.
            capture = not busy and graphs is not None and bool(graphs.pending)
            if not poller.poll(0 if busy or capture else IDLE_POLL_MS):
                if capture:
                    graphs.capture_pending()
                elif not busy and worked:
                    release_free_heap()  # idle for a while: what the work freed goes back
                    worked = False
                if plans is not None and not busy:
                    plans.tick()
            else:
                while True:
                    try:
                        msg = recv_nowait(inbox)
                    except zmq.Again:
                        break
                    if msg is not None:
                        replies += loop.handle(msg)
            replies += loop.step()
            for r in replies:
                send(out, r)
            if not scheduler.has_work and not parent_alive(parent_pid):
                break
        if plans is not None:
            plans.stop()
    except Exception as e:
        if tp is None:
            raise
        # A rank died, or a step failed with the ranks out of step: the group is over.
        message = f"tensor-parallel group failed: {type(e).__name__}: {e}"
        logger.error("%s", message)
        send(out, ProcessFailed("scheduler", message))
        time.sleep(0.5)
        beat.stop()
        os._exit(1)
    finally:
        beat.stop()
    if tp is not None:
        tp.destroy()
    logger.debug("scheduler process %d exits", os.getpid())
    inbox.close(0)
    out.close(0)
    ctx.term()


class Heartbeat:
    """A daemon thread that tells the front end, twice a second, the scheduler's latest stats
    and programs and how long ago its loop last iterated (`SchedulerHeartbeat`), on a socket of
    its own. The loop refreshes them at most every half `period_s`; a loop stuck in one long
    step keeps beating (torch releases the GIL) with a growing age, and a stopped process stops
    beating."""

    def __init__(
        self, ctx: zmq.Context, address: str, scheduler: Scheduler, period_s: float = 0.5
    ) -> None:
        self.scheduler = scheduler
        self.period_s = period_s
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, 4)  # a front end that stops reading loses beats only
        self._sock.connect(address)
        self._stats: tuple[dict[str, float], list[ProgramInfo]] = self._read()
        self._stats_at = self._iterated_at = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="braid-heartbeat", daemon=True)

    def _read(self) -> tuple[dict[str, float], list[ProgramInfo]]:
        return self.scheduler.control("stats"), self.scheduler.program_infos()

    def start(self) -> None:
        self._thread.start()

    def loop_iterated(self) -> None:
        """Called by the scheduler loop at the top of every iteration."""
        now = time.monotonic()
        self._iterated_at = now
        if now - self._stats_at >= self.period_s / 2:
            self._stats = self._read()  # a new tuple: the thread reads it whole
            self._stats_at = now

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            stats, programs = self._stats
            msg = SchedulerHeartbeat(stats, time.monotonic() - self._iterated_at, programs)
            try:
                self._sock.send_multipart(codec.encode(msg), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close(0)


def recv_nowait(sock: zmq.Socket) -> object | None:
    """Next message or `zmq.Again`; a malformed one is logged and dropped (None)."""
    frames = sock.recv_multipart(zmq.NOBLOCK)
    try:
        return codec.decode(frames)
    except Exception as e:  # msgspec.ValidationError, bad tag: never crash on input
        logger.error("dropping a malformed message: %s", e)
        return None
