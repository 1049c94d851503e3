"""`TokenizerManager`: the runtime's front end in the caller's process (asyncio).

It starts the scheduler and detokenizer processes with the `spawn` its creator hands it
(`braid.runtime.launch.spawn_runtime`: the process entry points are known there, not here),
sends tokenized requests to the scheduler over ZMQ, and routes the detokenizer's text deltas to
one collector per request. The HTTP server and the offline `LLM` both sit on it. A child
process that dies fails every request in flight and calls `on_failure` (the server exits with
the message).

The detokenizer sends one message per scheduler step with every request's delta. Each
collector wakes its reader at most once per message, and a reader that has not come back yet
finds the deltas that arrived meanwhile merged into one (`merge_str_outs`): a busy front end
then does its per-output work (an SSE chunk, a wake-up) once per reader turn, not once per
token, so it cannot fall further behind the scheduler the more streams it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import os
import random
import shutil
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from multiprocessing.process import BaseProcess
from pathlib import Path

import zmq
import zmq.asyncio

from braid.runtime.config import EngineConfig
from braid.runtime.errors import ParamError
from braid.runtime.ipc import codec
from braid.runtime.ipc.sockets import Addresses, Outbox
from braid.runtime.ipc.to_scheduler import (
    AbortReq,
    ControlReq,
    EmbedSpec,
    GenerateReq,
    ImageInput,
    ShutdownReq,
)
from braid.runtime.ipc.to_tokenizer import (
    BatchStrOut,
    ControlOut,
    ProcessFailed,
    ProgramInfo,
    SchedulerHeartbeat,
    SchedulerReady,
    StrOut,
)
from braid.runtime.sampling_params import SamplingParams, fold_seed
from braid.runtime.tokenizer.pending import Pending
from braid.runtime.tokenizer.request_checks import check_names, check_prompt_ids
from braid.runtime.tokenizer.tokenizer import bad_words_token_ids

logger = logging.getLogger(__name__)

# Starts a runtime's child processes, talking on the given addresses, and returns them started,
# by name: spawn(config, model_path, eos_token_ids, addrs, log_level).
Spawn = Callable[[EngineConfig, Path, frozenset[int], Addresses, str], dict[str, BaseProcess]]


class RuntimeDied(RuntimeError):
    """A runtime process died; the runtime cannot serve any more."""


class TokenizerManager:
    def __init__(
        self,
        config: EngineConfig,
        model_path: Path,
        eos_token_ids: frozenset[int],
        *,
        spawn: Spawn,
        log_level: str = "INFO",
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.model_path = model_path
        self.eos_token_ids = eos_token_ids
        self.log_level = log_level
        self.on_failure = on_failure
        self.spawn = spawn
        self.addrs = Addresses.fresh()
        self.procs: dict[str, BaseProcess] = {}
        self.ready: SchedulerReady | None = None
        self.failure: str | None = None
        # Samples in flight by wire id: the rid the scheduler knows, the caller's rid plus a
        # submission number, so a rid can be reused the moment its sample is left (an abort's
        # late outputs carry the old wire id and are dropped). `_wire`: caller's rid -> wire id.
        self._pending: dict[str, Pending] = {}
        self._wire: dict[str, str] = {}
        # For `abort`: the samples under each id a client holds, and each sample's id.
        self._groups: dict[str, set[str]] = {}
        self._group_of: dict[str, str] = {}
        self._submissions = itertools.count()
        self._control: dict[int, asyncio.Future] = {}
        self._control_ids = itertools.count()
        self._rng = random.Random(config.seed)
        # The tokenizer's encode (text -> ids, no special tokens), set by the front end that
        # loads it: `bad_words` become token ids with it (`resolve`).
        self.encode_words: Callable[[str], list[int]] | None = None
        self._tasks: list[asyncio.Task] = []
        self._closing = False
        # `stopping`: the caller is shutting down (a child that exits now is no failure);
        # `ended`: why every request was ended (`end_in_flight`), after which none is taken.
        self._stopping = False
        self.ended: str | None = None
        # The scheduler's latest heartbeat and when it came (event-loop time).
        self.heartbeat: SchedulerHeartbeat | None = None
        self._beat_at = 0.0
        self._unhealthy: str | None = None  # `problem`'s last answer (its changes are logged)
        # From the processes' start to the model loaded (`start`, or `spawn_early` to `start`'s
        # end).
        self.start_time_s = 0.0
        self._spawned_at: float | None = None
        self._spawning: Future | None = None  # `spawn_early`'s start, done in a thread
        self.start_wait_s = 0.0  # how long `start` itself took

    # ---- lifecycle ------------------------------------------------------------------------
    def _start_processes(self) -> None:
        self._spawned_at = time.perf_counter()
        self.procs = self.spawn(
            self.config, self.model_path, self.eos_token_ids, self.addrs, self.log_level
        )

    def spawn_early(self) -> None:
        """Start the runtime processes now, so that they load the model while the caller does
        the rest of its start-up (`braid serve` loads the tokenizer meanwhile); `start` then
        connects and waits for them. Their messages wait in ZMQ until `start` binds. A caller
        that fails before `start` stops them with `shutdown`. The starting itself runs in a
        thread: a process's first start from the fork server waits for the server's imports
        (1.5 s on the 2-core machine), which the caller's own start-up overlaps."""
        if self.procs or self._spawning is not None:
            return
        self._spawning = done = Future()

        def run() -> None:
            try:
                self._start_processes()
                done.set_result(None)
            except BaseException as e:  # noqa: BLE001 - re-raised by `start`
                done.set_exception(e)

        threading.Thread(target=run, name="braid-spawn", daemon=True).start()

    async def start(self, timeout: float = 600.0) -> SchedulerReady:
        """Start the processes (unless `spawn_early` did) and wait until the model is
        loaded."""
        entered = time.perf_counter()
        self._zctx = zmq.asyncio.Context()
        self._inbox = self._zctx.socket(zmq.PULL)
        self._inbox.bind(self.addrs.tokenizer)
        to_sched = self._zctx.socket(zmq.PUSH)
        to_sched.connect(self.addrs.scheduler)
        self._out = Outbox(to_sched)
        if self._spawning is not None:
            await asyncio.wrap_future(self._spawning)
        if not self.procs:
            self._start_processes()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.ready is None:
            if await self._inbox.poll(500):
                msg = codec.decode(await self._inbox.recv_multipart())
                if isinstance(msg, SchedulerReady):
                    self.ready = msg
                    self._beat_at = loop.time()
                elif isinstance(msg, ProcessFailed):
                    await self.shutdown()
                    raise ValueError(f"the {msg.process} process failed to start: {msg.error}")
            dead = self._dead_process()
            if dead:
                await self.shutdown()
                raise RuntimeDied(f"{dead} during start-up")
            if loop.time() > deadline:
                await self.shutdown()
                raise RuntimeDied(f"the model did not load within {timeout:.0f} s")
        now = time.perf_counter()
        self.start_time_s = now - (self._spawned_at or entered)
        self.start_wait_s = now - entered
        self._tasks = [
            asyncio.create_task(self._recv_loop()),
            asyncio.create_task(self._watchdog()),
        ]
        return self.ready

    def _dead_process(self) -> str | None:
        """ "the NAME process died (HOW)" for the first runtime process that ended, or None."""
        for name, p in self.procs.items():
            if not p.is_alive():
                code = p.exitcode
                how = f"exit code {code}"
                if code is not None and code < 0:
                    with contextlib.suppress(ValueError):
                        how = f"killed by {signal.Signals(-code).name}"
                return f"the {name} process died ({how})"
        return None

    async def _watchdog(self) -> None:
        """Fails the runtime when a process dies, or the scheduler is silent or in one step for
        `watchdog_timeout` (stopped or hung: its requests would wait for ever)."""
        limit = self.config.watchdog_timeout
        while not self._closing:
            await asyncio.sleep(0.5)
            if self._closing or self._stopping:
                continue
            dead = self._dead_process()
            if dead:
                self._fail(dead)
                return
            hung = self._problem(limit, limit) if self.ready is not None else None
            if hung and not self.failure:
                self._fail(f"{hung}, over the watchdog timeout ({limit:g} s)")
                return

    def _fail(self, message: str) -> None:
        if self.failure:
            return
        self.failure = message
        logger.error("runtime failure: %s", message)
        for rid, p in list(self._pending.items()):
            p.put(StrOut(rid, "", [], 0, 0, 0, finish_reason="abort", error=message))
        for fut in self._control.values():
            if not fut.done():
                fut.set_exception(RuntimeDied(message))
        if self.on_failure is not None:
            self.on_failure(message)

    def stopping(self) -> None:
        """The caller is shutting down: from now on a runtime process that exits is expected (a
        stop signal sent to the whole process group reaches them too), not a failure."""
        self._stopping = True

    def end_in_flight(self, reason: str) -> int:
        """End every sample in flight now: each stream ends with finish_reason "abort" and
        `reason` as its error, and the scheduler aborts it (its KV goes back as on any abort).
        Later submissions raise `RuntimeDied(reason)`. Returns how many samples were ended."""
        self._stopping = True
        self.ended = self.ended or reason
        if self.failure or self._closing:
            return 0
        ended = 0
        for wire, p in list(self._pending.items()):
            if p.finished:
                continue
            p.put(StrOut(wire, "", [], 0, 0, 0, finish_reason="abort", error=reason))
            self._out.send(AbortReq(wire))
            ended += 1
        return ended

    async def shutdown(self) -> None:
        """Stop the processes (scheduler first, politely; then anything left, firmly)."""
        if self._closing:
            return
        self._closing = True
        for t in self._tasks:
            t.cancel()
        if self._spawning is not None:
            with contextlib.suppress(Exception):  # `start` raised it, or nobody asks
                await asyncio.wait_for(asyncio.wrap_future(self._spawning), 60.0)
        try:
            self._out.send(ShutdownReq(), zmq.NOBLOCK)
        except (zmq.ZMQError, AttributeError):
            pass
        # The scheduler first (under tensor parallelism it stops the other ranks), then the
        # other ranks, then the detokenizer.
        names = ["scheduler"] + [n for n in self.procs if n not in ("scheduler", "detokenizer")]
        for name in names + ["detokenizer"]:
            p = self.procs.get(name)
            if p is None:
                continue
            await asyncio.to_thread(p.join, 0.1 if name == "detokenizer" else 3.0)
            if p.is_alive():
                p.terminate()
                await asyncio.to_thread(p.join, 3.0)
            if p.is_alive():
                p.kill()
                await asyncio.to_thread(p.join, 1.0)
        if hasattr(self, "_zctx"):
            self._inbox.close(0)
            self._out.close()
            self._zctx.term()
        shutil.rmtree(self.addrs.directory, ignore_errors=True)

    # ---- receiving ------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        while True:
            frames = await self._inbox.recv_multipart()
            try:
                msg = codec.decode(frames)
            except Exception as e:  # never crash on input
                logger.error("dropping a malformed message: %s", e)
                continue
            if isinstance(msg, BatchStrOut):
                pending = self._pending
                for out in msg.outputs:
                    p = pending.get(out.rid)
                    if p is not None:
                        p.put(out)
            elif isinstance(msg, ControlOut):
                fut = self._control.pop(msg.req_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, SchedulerHeartbeat):
                self.heartbeat = msg
                self._beat_at = asyncio.get_running_loop().time()
            elif isinstance(msg, ProcessFailed):
                self._fail(f"the {msg.process} process failed: {msg.error}")

    # ---- health ---------------------------------------------------------------------------
    def problem(self, silent_s: float = 10.0, stuck_s: float = 120.0) -> str | None:
        found = self._problem(silent_s, stuck_s)
        if found and not self._unhealthy and self.ready is not None and not self.failure:
            logger.warning("runtime unhealthy: %s", found)
        elif not found and self._unhealthy:
            logger.info("runtime healthy again (was: %s)", self._unhealthy)
        self._unhealthy = found
        return found

    def _problem(self, silent_s: float, stuck_s: float) -> str | None:
        """Why the runtime cannot serve now, or None: a process died, the scheduler has sent
        no heartbeat for `silent_s` (stopped, or too busy to run its threads), or its loop has
        not come round for `stuck_s` (one step that does not end)."""
        if self.failure:
            return self.failure
        if self.ready is None:
            return "the runtime is not started"
        quiet = asyncio.get_running_loop().time() - self._beat_at
        if quiet > silent_s:
            return f"the scheduler has not reported for {quiet:.1f} s"
        if self.heartbeat is not None and self.heartbeat.loop_age_s > stuck_s:
            return f"the scheduler has been in one step for {self.heartbeat.loop_age_s:.0f} s"
        return None

    def stats_snapshot(self) -> dict[str, float]:
        """The scheduler's stats from its latest heartbeat, with `stats_age_s` (how old they
        are) and `loop_age_s`; never waits on the scheduler."""
        beat = self.heartbeat
        if beat is None:
            return {}
        age = asyncio.get_running_loop().time() - self._beat_at
        return {**beat.stats, "stats_age_s": age, "loop_age_s": beat.loop_age_s + age}

    def programs_snapshot(self) -> list[ProgramInfo]:
        """The programs from the scheduler's latest heartbeat (as `stats_and_programs`);
        never waits on the scheduler."""
        return self.heartbeat.programs if self.heartbeat is not None else []

    # ---- requests -------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.failure or self.ended:
            raise RuntimeDied(self.failure or self.ended)
        if self.ready is None:
            raise RuntimeError("the runtime is not started")

    def validate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        where: str = "prompt",
        *,
        embed: bool = False,
    ) -> None:
        """Raise a `ParamError` naming `where` (the prompt's field) if the scheduler would
        refuse this request (`embed`: an embedding request, which may fill the whole context),
        or naming the sampling field at fault."""
        r = self.ready
        check_prompt_ids(input_ids, r.context_length, r.vocab_size, where, embed)
        resolved = self.resolve(params)
        resolved.check_token_ids(r.vocab_size)
        resolved.check_something_to_sample(self.eos_token_ids)

    def resolve(self, params: SamplingParams) -> SamplingParams:
        """`params` with `bad_words_token_ids` filled from `bad_words`
        (`tokenizer.bad_words_token_ids`); a `ParamError` if there is no tokenizer to make
        them, or a word makes no tokens."""
        if not params.bad_words or params.bad_words_token_ids is not None:
            return params
        if self.encode_words is None:
            raise ParamError("bad_words", "bad_words: this model has no tokenizer to read them")
        seqs = bad_words_token_ids(params.bad_words, self.encode_words)
        return params.replace(bad_words_token_ids=seqs)

    def sample_seed(self, params: SamplingParams, index: int) -> int:
        if params.seed is None:
            return fold_seed(self._rng.getrandbits(64))
        if index == 0:
            return fold_seed(params.seed)
        digest = hashlib.sha256(f"{params.seed}/{index}".encode()).digest()
        return fold_seed(int.from_bytes(digest[:8], "little"))

    def submit(
        self,
        rid: str,
        input_ids: list[int],
        params: SamplingParams,
        session_id: str | None = None,
        images: list[ImageInput] | None = None,
        grammar_wait: tuple[list[int], int | None] | None = None,
        session_ttl_s: float | None = None,
        embed: EmbedSpec | None = None,
        program_position: int | None = None,
        program_id: str | None = None,
        cache_salt: str | None = None,
        group: str | None = None,
        priority: int = 0,
    ) -> list[str]:
        """Queue `params.n` samples of one prompt (validated already); returns their rids.
        With `session_id`, each finished sample's sequence is pinned for that program session,
        for `session_ttl_s` seconds if given (else as long as the program's pauses suggest);
        `program_id`: the program run it belongs to (`GenerateReq`; default: the session's
        root); `program_position`: the call's position in its program, which needs a session
        or a program id.
        `images`: the prompt's processed images (`MediaFrontend.prepare`), whose tokens
        `input_ids` already holds. `grammar_wait`: (`grammar_after`, `grammar_open`), what the
        constraint waits for (see `GenerateReq`). `embed`: pool the prompt into an embedding
        instead (its one output carries `StrOut.embedding`). `cache_salt`: only requests with
        the same salt share this prompt's cached KV (`GenerateReq`, as `priority`). `group`:
        the id the client holds for these samples, if not `rid` (`abort` takes it)."""
        self._check_alive()
        params = self.resolve(params)
        if session_ttl_s is not None:
            if session_id is None:
                raise ParamError("session_ttl_s", "session_ttl_s needs a session_id")
            if not session_ttl_s > 0 or session_ttl_s == float("inf"):
                raise ParamError(
                    "session_ttl_s",
                    f"session_ttl_s must be a positive number, got {session_ttl_s!r}",
                )
        check_names(session_id=session_id, cache_salt=cache_salt, program_id=program_id)
        if program_position is not None:
            if session_id is None and program_id is None:
                raise ParamError(
                    "program_position", "program_position needs a session_id or a program_id"
                )
            if isinstance(program_position, bool) or not isinstance(program_position, int):
                raise ParamError(
                    "program_position",
                    f"program_position must be an integer, got {program_position!r}",
                )
            if not 0 <= program_position < 2**63:
                raise ParamError(
                    "program_position", f"program_position must be >= 0, got {program_position}"
                )
        rids = [f"{rid}/{k}" if params.n > 1 else rid for k in range(params.n)]
        for srid in rids:
            if srid in self._wire:
                raise ParamError("rid", f"request id {srid!r} is already in use")
        wires = [f"{srid}#{next(self._submissions)}" for srid in rids]
        # Encode every sample before registering any: a request that cannot be sent leaves
        # nothing behind (its rid stays free).
        reqs = [
            GenerateReq(
                wire,
                list(input_ids),
                params,
                self.sample_seed(params, k),
                session_id,
                images or [],
                list(grammar_wait[0]) if grammar_wait else [],
                grammar_wait[1] if grammar_wait else None,
                session_ttl_s=session_ttl_s,
                embed=embed,
                program_position=program_position,
                program_id=program_id,
                cache_salt=cache_salt,
                priority=priority,
            )
            for k, wire in enumerate(wires)
        ]
        try:
            encoded = [codec.encode(r) for r in reqs]
        except (TypeError, ValueError, OverflowError, UnicodeError) as e:
            raise ValueError(f"the request cannot be sent to the scheduler: {e}") from None
        members = self._groups.setdefault(group or rid, set())
        for srid, wire in zip(rids, wires):
            self._wire[srid] = wire
            self._pending[wire] = Pending()
            members.add(srid)
            self._group_of[srid] = group or rid
        self._out.requests(encoded)
        return rids

    def together(self) -> contextlib.AbstractContextManager[list[str]]:
        """Requests submitted in this block reach the scheduler as one message (`Outbox`); the
        block adds the rids it gets to the list it is given, cancelled if it raises."""
        return self._out.together(self.cancel)

    async def stream(self, rid: str) -> AsyncIterator[StrOut]:
        """The outputs of one sample until it finishes (each `StrOut.rid` is its wire id).
        Outputs that arrive while the reader is elsewhere come as one, merged
        (`merge_str_outs`): the concatenated texts are the same either way. Leaving early
        aborts it."""
        wire = self._wire[rid]
        p = self._pending[wire]
        try:
            while True:
                out = await p.take()
                yield out
                if out.finish_reason:
                    return
        finally:
            self._release(rid, wire, aborted=not p.finished)

    def _release(self, rid: str, wire: str, aborted: bool) -> None:
        if self._wire.get(rid) == wire:
            del self._wire[rid]
            group = self._group_of.pop(rid, None)
            if group is not None:
                self._groups[group].discard(rid)
                if not self._groups[group]:
                    del self._groups[group]
        self._pending.pop(wire, None)
        if aborted and not self.failure and not self._closing:
            self._out.send(AbortReq(wire))

    def cancel(self, rid: str) -> None:
        """Forget a submitted sample whose stream will never be read, and abort it."""
        wire = self._wire.get(rid)
        if wire is not None:
            self._release(rid, wire, aborted=True)

    def in_flight(self, rid: str) -> bool:
        """Whether sample `rid` was submitted and has not ended."""
        return rid in self._wire

    def abort(self, rid: str) -> int:
        """Abort what runs under `rid` (each stream ends with finish_reason "abort"): the
        sample `rid`, or every sample submitted under the id a client holds (`submit`'s
        `group`: a request's rid, an OpenAI response id). Returns how many were running."""
        if self.failure or self._closing:
            return 0
        rids = self._groups.get(rid, set()) | ({rid} if rid in self._wire else set())
        wires = [self._wire[r] for r in rids if r in self._wire]
        for wire in wires:
            self._out.send(AbortReq(wire))
        return len(wires)

    async def control(
        self, op: str, timeout: float = 60.0, arg: str | None = None
    ) -> dict[str, float]:
        """Run an operator request in the scheduler ("stats", "flush_cache",
        "check_invariants", "close_session" and "end_program" with `arg`); raises
        `RuntimeError` with the scheduler's message if it fails."""
        return (await self._ask(op, timeout, arg)).result

    async def profile(
        self, op: str, output_dir: str | None = None, timeout: float = 120.0
    ) -> list[str]:
        """ "start_profile" (the scheduler's torch profiler, its files to `output_dir`, else
        `$BRAID_TORCH_PROFILER_DIR`) or "stop_profile", which returns the files written.
        `ValueError` naming the problem when the scheduler refuses (no directory, a profile
        already running, none running)."""
        where = os.path.abspath(output_dir) if output_dir else None
        try:
            out = await self._ask(op, timeout, where)
        except RuntimeError as e:
            text = str(e)
            if text.startswith("ValueError: "):
                raise ValueError(text.removeprefix("ValueError: ")) from None
            raise
        return out.detail or []

    async def stats_and_programs(
        self, timeout: float = 60.0
    ) -> tuple[dict[str, float], list[ProgramInfo]]:
        """The scheduler's stats (as `control("stats")`) and, read with them, the programs in
        flight or holding pins (`ProgramInfo`)."""
        out = await self._ask("stats", timeout)
        return out.result, out.programs or []

    async def _ask(self, op: str, timeout: float, arg: str | None = None) -> ControlOut:
        self._check_alive()
        req_id = next(self._control_ids)
        fut = asyncio.get_running_loop().create_future()
        self._control[req_id] = fut
        self._out.send(ControlReq(req_id, op, arg))
        try:
            out: ControlOut = await asyncio.wait_for(fut, timeout)
        finally:
            self._control.pop(req_id, None)
        if not out.ok:
            raise RuntimeError(out.error)
        return out
