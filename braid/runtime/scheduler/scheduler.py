"""The scheduler: continuous batching over the paged KV pool and the radix prefix cache.

Its interface is message-shaped, so it can run in its own process: `handle()` takes a
`GenerateReq` or `AbortReq`, `step()` runs one step and returns `TokenOut`s.

A step polls the grammars that finished compiling, asks the prefill planner (`prefill.py`) or
the decode planner (`decode.py`) for a batch, hands it to the executor, and turns the samples
into outputs (`output.py`). After a prefill, running requests get a decode step before the next
prefill, so long prompts never starve them. Every request lives in one `RequestTable` with its
status; the KV each holds is `kv.py`'s, grammars and jump-forward are the `GrammarManager`'s.

With `overlap_schedule`, a decode step is read back only after the next one is queued on the
device (`overlap.py`), so the host's work for one step runs while the GPU computes the next.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

from braid.runtime.cache.radix_cache import NoPrefixCache, RadixCache
from braid.runtime.config import EngineConfig
from braid.runtime.constrained.compile_pool import AsyncGrammarCompiler
from braid.runtime.constrained.grammar import GrammarCompiler
from braid.runtime.constrained.manager import GrammarManager
from braid.runtime.errors import ParamError
from braid.runtime.executor.executor import Executor
from braid.runtime.executor.model_runner import ModelRunner
from braid.runtime.forward_batch import ForwardMode
from braid.runtime.ipc.to_detokenizer import Refusal, TokenOut
from braid.runtime.ipc.to_scheduler import AbortReq, GenerateReq
from braid.runtime.ipc.to_tokenizer import ProgramInfo
from braid.runtime.scheduler.batch import StepPlan
from braid.runtime.scheduler.decode import DecodePlanner
from braid.runtime.scheduler.kv import KVManager
from braid.runtime.scheduler.output import OutputProcessor
from braid.runtime.scheduler.overlap import Launched, next_step
from braid.runtime.scheduler.pin_cost import PinCost
from braid.runtime.scheduler.policies import check_priority, create_policy
from braid.runtime.scheduler.prefill import PrefillPlanner
from braid.runtime.scheduler.programs import ProgramTable
from braid.runtime.scheduler.request import Req, ReqStatus, RequestTable
from braid.runtime.scheduler.stats import SchedulerStats
from braid.runtime.scheduler.verify import Drafter, VerifyPlan
from braid.runtime.speculative import PROPOSERS
from braid.runtime.speculative.base import Proposer

logger = logging.getLogger(__name__)

# With only grammars compiling, a step waits this long for one (instead of spinning).
GRAMMAR_POLL_S = 0.01
ACTIVE = (ReqStatus.RUNNING, ReqStatus.JUMPED, ReqStatus.PREFILLING)  # requests holding KV
QUEUED = (ReqStatus.WAITING, ReqStatus.COMPILING)


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig,
        *,
        eos_token_ids: frozenset[int],
        grammar_compiler: AsyncGrammarCompiler | Callable[[], GrammarCompiler] | None = None,
    ) -> None:
        self.runner = runner
        self.executor = Executor(runner)
        self.device = runner.device
        self.vocab_size = runner.model_config.vocab_size
        self.context_length = runner.context_length
        # Vision-language models: the image token, and M-RoPE positions (Qwen2-VL family).
        self.image_token_id = runner.model_config.image_token_id
        rope = getattr(type(runner.model), "mrope_positions", None)
        self.image_rope = functools.partial(rope, runner.model_config) if rope else None
        self.check_image = getattr(runner.model, "check_image", None)
        # Embeddings pool the final hidden states, which only some model classes leave behind;
        # tensor parallelism's plan does not carry the capture yet.
        self.embed_refusal = None
        if not getattr(type(runner.model), "pools_hidden_states", False):
            arch = runner.model_config.architecture
            self.embed_refusal = f"input: this model ({arch}) does not produce embeddings"
        elif runner.tp is not None:
            self.embed_refusal = "input: embeddings are not supported with tensor parallelism"
        # A checkpoint without an LM head (`models/llama_embedding.py`) only embeds.
        self.generate_refusal = None
        if not getattr(type(runner.model), "generates", True):
            self.generate_refusal = (
                f"prompt: this model ({runner.model_config.architecture}) has no LM head; it "
                "serves embeddings only"
            )
        self.eos_token_ids = eos_token_ids
        # Speculative decoding: drafts verified with each decode step. Its steps are read back
        # before the next is planned (the next drafts depend on what this step keeps), so the
        # overlap schedule is off with it.
        self.proposer: Proposer | None = None
        if config.speculative_algorithm is not None:
            cls = PROPOSERS.get(config.speculative_algorithm)
            self.proposer = cls.from_config(config, runner)
        self.overlap = config.use_overlap_schedule and self.proposer is None
        # What the proposer reads of each forward (the decode graphs were captured with it).
        self.capture_hidden = runner.capture_hidden
        self.stats = SchedulerStats()
        # Programs (braid programs, sessions): per-program service and pin TTLs; only a
        # policy that orders by service keeps programs' sequences to tell tokens computed
        # again from new ones.
        policy = create_policy(config.schedule_policy)
        self.schedule_policy = policy.name
        self.programs = ProgramTable(
            config.session_ttl_s,
            config.session_ttl_s,
            remember=policy.remembers_sequences,
        )
        self.requests = RequestTable(self.programs)
        allocator = runner.kv_pool.allocator
        cache = NoPrefixCache(allocator) if config.disable_radix_cache else RadixCache(allocator)
        self.kv = KVManager(
            allocator,
            runner.req_to_token,
            cache,
            self.stats,
            config.max_session_pins,
            config.session_ttl_s,
            runner.kv_pool,
        )
        self.grammars = GrammarManager(
            grammar_compiler,
            config.grammar_compile_timeout_s,
            self.vocab_size,
            self.device,
            jump_forward=config.use_jump_forward,
        )
        self.grammars.fill_early = not config.disable_grammar_mask_thread
        self.grammars.warm()
        self.kv.pin_ttl = self.programs.pin_ttl
        # Pins only where they pay on this device and pool (`pin_cost`): prefill steps are timed.
        self.pin_cost = PinCost(allocator.capacity_pages * allocator.page_size)
        self.kv.pin_pays = self._pin_pays
        drafter = None
        if self.proposer is not None:
            self.kv.on_release = self.proposer.release
            drafter = Drafter(
                self.proposer,
                config.speculative_steps,
                self.kv,
                self.context_length,
                self.vocab_size,
            )
        self.decode = DecodePlanner(
            self.requests, self.kv, self.stats, self.device, policy.retract_victim, drafter
        )
        max_prefill = config.effective_max_prefill_tokens
        chunk = config.effective_chunked_prefill_size
        self.prefill = PrefillPlanner(
            self.requests,
            self.kv,
            self.decode,
            self.grammars,
            self.stats,
            self.device,
            budget=min(max_prefill, chunk or max_prefill),
            chunked=chunk is not None,
            policy=policy,
            max_running=runner.max_running_requests,
            mix_decode=config.enable_mixed_chunk,
            whole_prompts=config.avoid_partial_chunks,
        )
        self.output = OutputProcessor(
            self.requests,
            self.kv,
            self.grammars,
            self.executor,
            self.stats,
            eos_token_ids,
            speculative=self.proposer is not None,
        )
        self._last_was_prefill = False
        self._launched: Launched | None = None  # a decode step queued, not yet read back

    # ---- views ----------------------------------------------------------------------------
    @property
    def waiting(self) -> list[Req]:
        return self.requests.view(ReqStatus.WAITING)

    @property
    def running(self) -> list[Req]:
        return self.requests.view(ReqStatus.RUNNING)

    @property
    def prefilling(self) -> Req | None:
        """The prompt between chunks (at most one, between steps)."""
        return self.requests.first(ReqStatus.PREFILLING)

    @property
    def has_work(self) -> bool:
        return bool(len(self.requests) or self._launched)

    # ---- messages in ----------------------------------------------------------------------
    def handle(self, msg: GenerateReq | AbortReq) -> list[TokenOut]:
        if isinstance(msg, GenerateReq):
            self._add(msg)
            return []
        if isinstance(msg, AbortReq):
            req = self.requests.get(msg.rid)
            return [] if req is None else [self._abort(req)]
        raise TypeError(f"scheduler cannot handle {type(msg).__name__}")

    def _add(self, msg: GenerateReq) -> None:
        check_priority(msg.priority, self.schedule_policy)
        if msg.embed is not None and self.embed_refusal is not None:
            raise ParamError("input", self.embed_refusal)
        if msg.embed is None and self.generate_refusal is not None:
            raise ParamError("prompt", self.generate_refusal)
        req = Req.from_message(
            msg,
            self.context_length,
            self.vocab_size,
            self.eos_token_ids,
            self.image_token_id,
            self.image_rope,
            self.check_image,
        )
        if self.requests.get(req.rid) is not None:
            raise ParamError.at("rid", f"{req.rid!r} is already in use by a request in flight")
        if msg.params.constraint is not None and req.max_new_tokens > 0:
            self.grammars.add(req, *msg.params.constraint)
            self.requests.add(req, ReqStatus.COMPILING)
            return
        self.requests.add(req, ReqStatus.WAITING)

    def _abort(self, req: Req, error: str | None = None) -> TokenOut:
        if req.status is ReqStatus.COMPILING:
            self.grammars.remove(req)
        return self.output.finish(req, "abort", error)

    def _poll_grammars(self) -> list[TokenOut]:
        """Queue the requests whose grammar is ready; fail those whose grammar failed."""
        ready, failed = self.grammars.poll()
        for req in ready:
            req.hold_grammar()  # a reasoning model's constraint waits for the end of thinking
            if req.grammar is not None:
                self.output.jump_forward(req)  # over any text the grammar forces at the start
            self.requests.move(req, ReqStatus.WAITING)
        outs = []
        for req, error in failed:
            out = self.output.finish(req, "abort", error)
            # The grammar is the request's: the front end answers 400, naming its field.
            out.refused = Refusal(req.params.constraint[0])
            outs.append(out)
        return outs

    # ---- the step -------------------------------------------------------------------------
    def expire(self) -> None:
        """Release the session pins past their TTL and forget the programs idle too long."""
        self.kv.sessions.expire()
        self.programs.expire()

    def step(self) -> list[TokenOut]:
        """Run one step and return what each request in it gained (plus requests that failed
        while scheduling). With `overlap`, a decode step's tokens come out of the next call,
        which first queues the decode after it when nothing else should run next."""
        self.expire()
        outs = self._poll_grammars()
        launched, self._launched = self._launched, None
        if launched is not None:
            ahead = self._run_ahead(launched)
            fill = None
            if ahead is not None and ahead.result is None:  # its masks can start right away
                fill = lambda: self.grammars.start_fill(ahead.plan.sampling)  # noqa: E731
            outs += self.output.process(
                launched.plan, launched.result, None, launched.dropped, fill
            )
            if ahead is not None:
                if ahead.result is None:
                    ahead = self._sample_ahead(ahead)
                self._launched = ahead
                return outs
        plan = None
        if not (self._last_was_prefill and self.running):
            plan = self.prefill.plan()
        if plan is None and self.running:
            plan, too_big = self.decode.plan()
            if too_big is not None:
                outs.append(self.output.finish(too_big, "abort", self._out_of_memory(too_big)))
            if plan is None and not self.running:  # all retracted for a prompt between chunks
                plan = self.prefill.plan()
        self._last_was_prefill = (
            plan is not None
            and plan.batch.mode is ForwardMode.EXTEND
            and not self._decoded_all(plan)
        )
        if plan is None:
            if not outs and self.requests.count(ReqStatus.WAITING, ReqStatus.PREFILLING):
                if not self.running:
                    raise RuntimeError("scheduler stalled: requests wait but none can be admitted")
            if not outs and len(self.grammars):
                self.grammars.wait(GRAMMAR_POLL_S)  # nothing else to do but not spin
            return outs
        if isinstance(plan, VerifyPlan):
            return outs + self._verify(plan)
        if plan.batch.mode is ForwardMode.DECODE:
            launched = self._launch_decode(plan)
            if self.overlap:
                self._launched = launched
                return outs
            return outs + self.output.process(plan, launched.result, None)
        inputs = [r.sampling for r in plan.sampling]
        masks = lambda: self.grammars.mask(plan.sampling)  # noqa: E731
        self._capture(plan)
        t0 = time.perf_counter()
        logits, result = self.executor.extend(plan.batch, plan.last_rows, inputs, masks)
        outs += self.output.process(plan, result, logits)
        if result is not None:  # its samples were read back: the device is done with it
            self.pin_cost.observe_prefill(plan.batch.num_tokens, time.perf_counter() - t0)
        if self.proposer is not None and plan.batch.capture_hidden:
            offsets = [0]
            for n in plan.batch.extend_lens[:-1]:
                offsets.append(offsets[-1] + n)
            # Each request's rows up to the KV it kept (jump-forward tokens it verified).
            kept = [
                range(o, o + max(0, r.kv_len - p))
                for r, o, p in zip(plan.reqs, offsets, plan.batch.prefix_lens)
            ]
            self._observe(plan.reqs, plan.batch.prefix_lens, kept, plan.batch)
        return outs

    def _pin_pays(self, req: Req) -> bool:
        """Whether a finished session request's KV is worth pinning: always with a TTL the
        client set, or when no request waits (the pin then keeps nothing out, and gives way to
        the queue's head if one comes); under a queue, where `pin_cost` says it pays."""
        if req.session_ttl_s is not None or not self.requests.count(ReqStatus.WAITING):
            return True
        return self.pin_cost.pays(self.programs.expected_pause(req))

    def _decoded_all(self, plan: StepPlan) -> bool:
        """Whether a mixed extend carries a decode row of every running request (then the
        next step may be a prefill again: nobody waits for a decode)."""
        if not plan.decode_rows:
            return False
        rows = {id(r) for r in plan.reqs[len(plan.prefilled) :]}
        return all(id(r) in rows for r in self.running)

    def _capture(self, plan: StepPlan) -> None:
        """Ask `plan`'s forward for the hidden states the proposer reads."""
        if self.capture_hidden:
            plan.batch.capture_hidden, plan.batch.aux_layers = True, self.runner.aux_layers

    def _observe(self, reqs: list[Req], starts: list[int], rows: list[range], batch) -> None:
        """Hand the proposer the hidden states of the positions each running request kept."""
        live = [(r, s, list(k)) for r, s, k in zip(reqs, starts, rows) if not r.finished and k]
        if live:
            self.proposer.observe(*map(list, zip(*live)), batch)

    def _out_of_memory(self, req: Req) -> str:
        return (
            f"out of KV memory: the request needs {req.seq_len} tokens of KV and "
            f"the pool holds {self.kv.allocator.capacity_tokens}"
        )

    def _launch_decode(self, plan: StepPlan, ahead: int = 0) -> Launched:
        """Queue a decode step on the device; nothing is read back. The requests' `kv_len`
        counts the KV this step writes from now on: whatever later reads it is queued after
        it."""
        for req, end in zip(plan.reqs, plan.ends):
            req.kv_len = end
        inputs = [r.sampling for r in plan.sampling]
        masks = lambda: self.grammars.mask(plan.sampling)  # noqa: E731
        return Launched(plan, self.executor.launch_decode(plan.batch, inputs, masks, ahead))

    def _verify(self, plan: VerifyPlan) -> list[TokenOut]:
        """Run a verify step and keep, for each request, its drafts up to the first its target
        disagrees with, plus the target's token there (`OutputProcessor.process_verify`)."""
        for req, end in zip(plan.reqs, plan.ends):
            req.kv_len = end
        masks = lambda: self.grammars.mask_drafts(  # noqa: E731
            plan.reqs, plan.drafts, plan.first_rows, self.eos_token_ids
        )
        self._capture(plan)
        result = self.executor.launch_decode(plan.batch, plan.inputs, masks)
        outs = self.output.process_verify(plan, result, self.proposer)
        if plan.batch.capture_hidden:  # the rows of the KV each kept, from its last token on
            self._observe(plan.reqs, plan.roots, plan.kept_rows, plan.batch)
        return outs

    def _run_ahead(self, launched: Launched) -> Launched | None:
        """Queue the decode step that follows `launched` when `overlap.next_step` says it is
        what would run next anyway; else None."""
        if not self.overlap:
            return None
        step = next_step(
            launched, self.requests, self.prefill.admits_now, self.kv.make_room, self.kv.page_size
        )
        if step is None:
            return None
        reqs, ids, rows = step
        plan = self.decode.plan_ahead(reqs, ids, rows)
        self.stats.decode_steps_ahead += 1
        if all(r.grammar is None and r.waiting_grammar is None for r in plan.sampling):
            return self._launch_decode(plan, ahead=1)
        # Constrained rows: the masks wait for this step's tokens (`_sample_ahead`).
        for req, end in zip(plan.reqs, plan.ends):
            req.kv_len = end
        self.stats.constrained_steps_ahead += 1
        return Launched(plan, None, logits=self.executor.launch_forward(plan.batch))

    def _sample_ahead(self, launched: Launched) -> Launched:
        """Queue the sampling of a step run ahead with constrained rows, now that the step
        before it has been read back and its tokens have advanced the grammars. A request
        that step jumped forward drops its row here and gives back the KV the row wrote (its
        input token's), which the extend over its forced tokens computes again."""
        dropped = set()
        for req in launched.plan.sampling:
            if not req.finished and req.status is ReqStatus.JUMPED:
                dropped.add(id(req))
                self.kv.trim(req, req.kv_len - 1)
        plan = launched.plan
        inputs = [r.sampling for r in plan.sampling]
        live = [None if id(r) in dropped or r.finished else r for r in plan.sampling]
        masks = lambda: self.grammars.mask(live)  # noqa: E731
        result = self.executor.launch_sample(launched.logits, inputs, masks)
        return Launched(plan, result, dropped=frozenset(dropped))

    def fail_all(self, error: str) -> list[TokenOut]:
        """Fail every request, including those of a step that raised midway, releasing all
        their KV: whatever the failed step was writing is suspect, so none of it is cached."""
        self._launched = None
        self.grammars.clear()
        reqs = list(self.requests)
        for r in reqs:
            self.kv.release(r, keep_kv=False)
        return [self.output.finish(r, "abort", error) for r in reqs]

    def abort_all(self) -> list[TokenOut]:
        """Abort every request (after a failed forward, or at shutdown)."""
        return [self._abort(req) for req in self.requests]

    # ---- control --------------------------------------------------------------------------
    @property
    def grammar_compiler(self) -> GrammarCompiler | None:
        """The grammar compiler, once the first constrained request has built it."""
        return self.grammars.compiler

    def control(self, op: str, arg: str | None = None) -> dict[str, float]:
        """Answer an operator request ("stats", "flush_cache", "check_invariants",
        "close_session" with the session id in `arg`, "end_program" with a program id
        sent without a session); raises `ValueError` for an unknown op
        and `AssertionError` when invariants fail."""
        if op == "close_session":
            if not arg:
                raise ValueError("close_session: needs a session id")
            return {"closed": float(self.close_session(arg))}
        if op == "end_program":
            if not arg:
                raise ValueError("end_program: needs a program id")
            return {"ended": float(self.programs.end(arg))}
        if op == "stats":
            return (
                self.stats.as_dict()
                | self.usage()
                | self.image_stats()
                | self.grammars.counters()
                | self.programs.stats()
                | {"pins_declined": float(self.pin_cost.declined)}
            )
        if op == "flush_cache":
            return {"flushed": float(self.flush_cache())}
        if op == "check_invariants":
            self.check_invariants()
            return {}
        raise ValueError(f"unknown control op {op!r}")

    def program_infos(self) -> list[ProgramInfo]:
        """The programs in flight or holding pins, with their calls, service and pinned KV
        (`ProgramTable.infos`)."""
        return self.programs.infos(self.kv.pinned_by_program())

    def close_session(self, session: str) -> bool:
        """Release `session`'s pin; whether a pin was released. Its program forgets the
        session; closing a program's root session ends the program and releases its forks'
        pins too (a client that closes only the root leaves none behind). A request of the
        session (or, for a root, of its forks) still running will not pin when it ends."""
        for req in self.requests:
            sid = req.session_id
            root = "." not in session
            if sid is not None and (sid == session or root and sid.startswith(session + ".")):
                req.session_closed = True
        self.programs.close_session(session)
        forks = 0
        if "." not in session:
            self.programs.end(session)
            forks = self.kv.sessions.close_forks(session)
        return self.kv.sessions.close(session) or forks > 0

    def usage(self) -> dict[str, float]:
        graphs = self.runner.graph_runner
        return (
            {
                "running_requests": float(self.requests.count(*ACTIVE)),
                "queued_requests": float(self.requests.count(*QUEUED)),
                # Decode batch sizes still to be captured in idle time (a request arriving
                # meanwhile may wait for one capture).
                "cuda_graph_sizes_pending": float(len(graphs.pending) if graphs else 0),
            }
            | self.kv.usage()
            | self._tp_usage()
        )

    def _tp_usage(self) -> dict[str, float]:
        tp = self.runner.tp
        if tp is None:
            return {}
        # Whether a decode's all-reduces take the one-shot path (`TPGroup.enable_one_shot`).
        return {"tp_one_shot_all_reduce": float(tp.one_shot)}

    def image_stats(self) -> dict[str, float]:
        """The vision-tower counters (none for a text-only model)."""
        cache = self.runner.encoder_cache
        if cache is None:
            return {}
        return {
            "images_encoded": float(cache.images_encoded),
            "image_cache_hits": float(cache.hits),
            "encoder_cache_images": float(len(cache)),
            "encoder_cache_bytes": float(cache.nbytes),
            "encoder_seconds": cache.seconds,
        }

    def flush_cache(self) -> bool:
        """Empty the prefix cache (and the vision-tower outputs). Only when nothing runs;
        returns whether it flushed."""
        if self.requests.count(*ACTIVE):
            return False
        self.kv.flush()
        if self.runner.encoder_cache is not None:
            self.runner.encoder_cache.clear()
        return True

    def check_invariants(self) -> None:
        """Every KV page is free, held by exactly one active request, or held by the cache;
        every cache lock is held by exactly one active request's prefix or a session pin;
        every request has one status, and those compiling are the grammar manager's; under
        tensor parallelism, every rank's request-to-token table equals rank 0's."""
        active, queued = self.requests.view(*ACTIVE), self.requests.view(*QUEUED)
        assert len(active) + len(queued) == len(self.requests), "a request without a status"
        compiling = {id(r) for r in self.requests.view(ReqStatus.COMPILING)}
        assert compiling == {id(r) for r in self.grammars}, "grammar waiting != COMPILING"
        self.kv.check_invariants(active, queued)
        if self.runner.plans is not None:  # tensor parallelism: every rank's table is ours
            self.runner.plans.check()
