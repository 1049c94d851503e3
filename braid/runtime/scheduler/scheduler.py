"""The scheduler: continuous batching over the paged KV pool and the radix prefix cache.

Its interface is message-shaped, so it can run in its own process: `handle()` takes a
`GenerateReq` or `AbortReq`, `step()` runs one forward and returns `TokenOut`s.

One step is either a prefill (new requests, the next chunk of a long prompt, resumed requests)
or a decode of every running request; after a prefill, running requests get a decode step
before the next prefill, so long prompts never starve them. Admission is optimistic: a request
is admitted when its prefill fits and the decodes in flight keep an estimated reserve; when
decoding runs out of pages anyway, the newest requests are retracted (their KV goes to the
prefix cache, they wait again with their output kept) and resume later.

With `overlap_schedule`, a decode step is read back only after the next one is queued on the
device (`overlap.py`), so the host's work for one step runs while the GPU computes the next.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from braid.runtime.cache.radix_cache import NoPrefixCache, PrefixCache, RadixCache
from braid.runtime.constrained.bitmask import BitmaskBuffer, bitmask_words
from braid.runtime.constrained.compile_pool import AsyncGrammarCompiler, PendingGrammars
from braid.runtime.constrained.grammar import GrammarCompiler, GrammarMatcher
from braid.runtime.constrained.jump_forward import jump_tokens
from braid.runtime.executor.forward_batch import ForwardMode, to_device
from braid.runtime.executor.model_runner import ModelRunner
from braid.runtime.executor.sampler import Sampler, SampleResult, SamplingInput
from braid.runtime.ipc.to_detokenizer import DetokSpec, TokenOut
from braid.runtime.ipc.to_scheduler import AbortReq, GenerateReq
from braid.runtime.scheduler.batch import StepPlan, build_decode, build_extend
from braid.runtime.scheduler.logprobs import prompt_logprobs, token_logprobs
from braid.runtime.scheduler.overlap import Launched, can_run_ahead, finishes_by_length
from braid.runtime.scheduler.policy import (
    POLICIES,
    candidates,
    effective_policy,
    match_limit,
    shares_uncached_prefix,
)
from braid.runtime.scheduler.request import Req
from braid.runtime.scheduler.sessions import SessionPins
from braid.runtime.tokenizer.detokenizer import CONTEXT_TOKENS

logger = logging.getLogger(__name__)

# Admission reserves this fraction of each running request's remaining tokens (at most
# RESERVE_CLIP of them) for future decodes; the fraction decays while decoding goes well and
# jumps back up after a retraction.
NEW_TOKEN_RATIO_INIT = 0.7
NEW_TOKEN_RATIO_MIN = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
RESERVE_CLIP = 4096
# With only grammars compiling, a step waits this long for one (instead of spinning).
GRAMMAR_POLL_S = 0.01


@dataclass
class SchedulerStats:
    """Counters since start (or the last `reset`)."""

    finished_requests: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission)
    cached_prompt_tokens: int = 0  # of those, supplied by the prefix cache
    prefill_tokens_computed: int = 0  # tokens actually run through prefill (incl. resumes)
    decode_steps: int = 0
    prefill_steps: int = 0
    retractions: int = 0
    evicted_tokens: int = 0
    jump_forward_tokens: int = 0  # output tokens a grammar forced, appended without sampling
    jump_forward_rejected: int = 0  # of those, dropped because greedy decoding chose otherwise

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        d = dict(self.__dict__)
        d["cache_hit_rate"] = self.cache_hit_rate
        return d


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        eos_token_ids: frozenset[int],
        max_prefill_tokens: int,
        chunked_prefill_size: int | None = None,
        schedule_policy: str = "lpm",
        disable_radix_cache: bool = False,
        grammar_compiler: Callable[[], GrammarCompiler] | None = None,
        grammar_compile_timeout_s: float = 30.0,
        disable_jump_forward: bool = False,
        overlap_schedule: bool = False,
        max_session_pins: int = 64,
        session_ttl_s: float = 600.0,
    ) -> None:
        if schedule_policy not in POLICIES:
            raise ValueError(f"schedule_policy must be one of {POLICIES}, got {schedule_policy!r}")
        self.runner = runner
        self.allocator = runner.kv_pool.allocator
        self.page_size = self.allocator.page_size
        self.table = runner.req_to_token
        self.device = runner.device
        self.vocab_size = runner.model_config.vocab_size
        self.sampler = Sampler(self.vocab_size, self.device)
        self.eos_token_ids = eos_token_ids
        self.prefill_budget = min(max_prefill_tokens, chunked_prefill_size or max_prefill_tokens)
        self.chunked_prefill = chunked_prefill_size is not None
        self.policy = schedule_policy
        self.cache: PrefixCache = (
            NoPrefixCache(self.allocator) if disable_radix_cache else RadixCache(self.allocator)
        )
        self.max_running = runner.max_running_requests
        self.context_length = runner.context_length
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.prefilling: Req | None = None  # a long prompt between chunks
        self.stats = SchedulerStats()
        self.in_flight: list[Req] = []  # the requests of the step being run
        # Program sessions: the cache path of each running program's state stays locked.
        self.sessions = SessionPins(
            self.cache, self.allocator.capacity_pages // 2, max_session_pins, session_ttl_s
        )
        # Constrained requests wait in `grammar_waiting` (not admitted) while their grammar
        # compiles in worker processes. `jumped`: running requests holding jump-forward tokens
        # whose KV the next extend computes (they are out of `running` until then).
        self._has_tokenizer = grammar_compiler is not None
        self.grammar_waiting: PendingGrammars[Req] = PendingGrammars(
            AsyncGrammarCompiler(grammar_compiler or _no_tokenizer), grammar_compile_timeout_s
        )
        self.jumped: list[Req] = []
        self.jump_forward = not disable_jump_forward
        self._bitmask: BitmaskBuffer | None = None
        self._new_token_ratio = NEW_TOKEN_RATIO_INIT
        self._last_was_prefill = False
        self.overlap = overlap_schedule
        self._launched: Launched | None = None  # a decode step queued, not yet read back

    # ---- messages in ----------------------------------------------------------------------
    def handle(self, msg: GenerateReq | AbortReq) -> list[TokenOut]:
        if isinstance(msg, GenerateReq):
            self._add(msg)
            return []
        if isinstance(msg, AbortReq):
            return self._abort(msg.rid)
        raise TypeError(f"scheduler cannot handle {type(msg).__name__}")

    def _add(self, msg: GenerateReq) -> None:
        n = len(msg.input_ids)
        if n == 0:
            raise ValueError("prompt: must contain at least one token")
        if n >= self.context_length:
            raise ValueError(
                f"prompt: {n} tokens leave no room to generate within the context length "
                f"({self.context_length})"
            )
        if max(msg.input_ids) >= self.vocab_size or min(msg.input_ids) < 0:
            raise ValueError(f"prompt: token ids must be in [0, {self.vocab_size})")
        max_new = self.context_length - n
        if msg.params.max_tokens is not None:
            max_new = min(max_new, msg.params.max_tokens)
        req = Req(
            rid=msg.rid,
            input_ids=list(msg.input_ids),
            params=msg.params,
            seed=msg.seed,
            eos_ids=self.eos_token_ids,
            max_new_tokens=max_new,
            session_id=msg.session_id,
        )
        if msg.params.constraint is not None and max_new > 0:
            if not self._has_tokenizer:
                raise ValueError("json_schema/regex/choice: this model has no tokenizer")
            self.grammar_waiting.add(req, *msg.params.constraint)
            return
        self.waiting.append(req)

    @property
    def grammar_compiler(self) -> GrammarCompiler | None:
        """The grammar compiler, once the first constrained request has built it."""
        return self.grammar_waiting.compiler.compiler

    def _poll_grammars(self) -> list[TokenOut]:
        """Queue the requests whose grammar is ready (after any text it forces at the start);
        fail those whose grammar failed to compile or ran out of time."""
        if not len(self.grammar_waiting):
            return []
        ready, failed = self.grammar_waiting.poll()
        for req, grammar in ready:
            req.grammar = GrammarMatcher(grammar)
            self._jump_forward(req)
            self.waiting.append(req)
        outs = [self._finish(req, "abort", error) for req, error in failed]
        for out in outs:
            out.refused = True  # the grammar is the request's: the front end answers 400
        return outs

    def _abort(self, rid: str, error: str | None = None) -> list[TokenOut]:
        for req in self.grammar_waiting:
            if req.rid == rid:
                self.grammar_waiting.remove(req)
                return [self._finish(req, "abort", error)]
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                return [self._finish(req, "abort", error)]
        for req in self.running + self.jumped + ([self.prefilling] if self.prefilling else []):
            if req.rid == rid:
                return [self._finish(req, "abort", error)]
        return []

    # ---- the step -------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(
            self.waiting
            or self.running
            or self.prefilling
            or self.jumped
            or self.grammar_waiting
            or self._launched
        )

    def step(self) -> list[TokenOut]:
        """Run one forward and return what each request in it gained (plus requests that
        failed while scheduling). With `overlap`, a decode step's tokens come out of the next
        call, which first queues the decode after it when nothing else should run next."""
        self.sessions.expire()
        outs = self._poll_grammars()
        launched, self._launched = self._launched, None
        if launched is not None:
            ahead = self._run_ahead(launched)
            outs += self._process(launched.plan, launched.result, None)
            if ahead is not None:
                self._launched = ahead
                return outs
            self.in_flight = []
        plan = None
        if not (self._last_was_prefill and self.running):
            plan = self._schedule_prefill()
        if plan is None and self.running:
            plan = self._schedule_decode(outs)
        self._last_was_prefill = plan is not None and plan.batch.mode.value == "extend"
        if plan is None:
            if not outs and (self.waiting or self.prefilling) and not self.running:
                raise RuntimeError("scheduler stalled: requests wait but none can be admitted")
            if not outs and self.grammar_waiting:
                self.grammar_waiting.wait(GRAMMAR_POLL_S)  # nothing else to do but not spin
            return outs
        self.in_flight = plan.reqs
        if plan.batch.mode is ForwardMode.DECODE:
            launched = self._launch_decode(plan)
            if self.overlap:
                self._launched = launched
                return outs
            outs += self._process(plan, launched.result, None)
        else:
            logits = self.runner.forward(plan.batch)
            result = None
            if plan.sampling:
                rows = plan.last_rows
                last = logits[rows] if len(rows) != logits.shape[0] else logits
                inputs = [r.sampling for r in plan.sampling]
                result = self.sampler.sample(last, inputs, **self._grammar_mask(plan.sampling))
            outs += self._process(plan, result, logits)
        self.in_flight = []
        return outs

    def _launch_decode(self, plan: StepPlan, ahead: int = 0) -> Launched:
        """Queue a decode forward and its sampling on the device; nothing is read back. The
        requests' `kv_len` counts the KV this step writes from now on: whatever later reads it
        is queued after it."""
        for req, end in zip(plan.reqs, plan.ends):
            req.kv_len = end
        logits = self.runner.forward(plan.batch)
        inputs = [r.sampling for r in plan.sampling]
        mask = self._grammar_mask(plan.sampling)
        result = self.sampler.sample(logits, inputs, **mask, ahead=ahead)
        result.copy_to_host_async()
        return Launched(plan, result)

    def _run_ahead(self, launched: Launched) -> Launched | None:
        """Queue the decode step that follows `launched`, fed by its samples on the device,
        when that step is what would run next anyway (nothing to admit, every request able to
        sample ahead, pages free); else None."""
        if not self.overlap or launched.plan.batch.mode is not ForwardMode.DECODE:
            return None
        if self.prefilling is not None or self.jumped:
            return None
        if self._admits_now():
            return None  # a prefill comes first
        reqs = launched.plan.reqs
        in_step = {id(r) for r in reqs}
        if any(id(r) not in in_step for r in self.running):
            return None
        keep = [i for i, r in enumerate(reqs) if not r.finished and not finishes_by_length(r)]
        if not keep or not all(can_run_ahead(reqs[i]) for i in keep):
            return None
        nxt = [reqs[i] for i in keep]
        need = sum(1 for r in nxt if r.kv_len % self.page_size == 0)
        if not self._free_pages_after_evicting(need):
            return None
        ids = launched.result.next_ids
        if len(keep) < len(reqs):
            ids = ids[to_device(keep, self.device)]
        self._count_decode_step()
        plan = build_decode(nxt, self.allocator, self.table, self.device, input_ids=ids)
        self.in_flight = nxt
        return self._launch_decode(plan, ahead=1)

    def fail_all(self, error: str) -> list[TokenOut]:
        """Fail every request, including those of a step that raised midway (admitted but not
        yet running), releasing all their KV."""
        reqs = list(self.waiting) + self.running + ([self.prefilling] if self.prefilling else [])
        reqs += self.jumped + self.grammar_waiting.clear()
        reqs += [r for r in self.in_flight if r not in reqs and not r.finished]
        self.waiting.clear()
        self.in_flight = []
        self._launched = None
        for r in reqs:
            # Whatever KV the failed step was writing is suspect: none of it goes to the cache.
            if r.pool_row is not None or r.pages:
                self._release(r, keep_kv=False)
        return [self._finish(r, "abort", error) for r in reqs]

    # ---- prefill --------------------------------------------------------------------------
    def _free_pages_after_evicting(self, need: int) -> bool:
        """Make `need` pages free, evicting unlocked cache pages if necessary."""
        short = need - self.allocator.free_pages
        if short > 0:
            freed = self.cache.evict(short)
            self.stats.evicted_tokens += freed * self.page_size
        return self.allocator.free_pages >= need

    def _decode_reserve(self, reqs: list[Req]) -> int:
        tokens = sum(min(r.remaining_new_tokens, RESERVE_CLIP) for r in reqs)
        return self.allocator.pages_for(int(tokens * self._new_token_ratio))

    def _schedule_prefill(self) -> StepPlan | None:
        items = self._jumped_items()
        budget = self.prefill_budget - sum(end - r.kv_len for r, end in items)
        if self.prefilling is not None:
            req = self.prefilling
            end = self._chunk_end(req.kv_len, req, budget)
            grow = self._pages_to_grow(req, end)
            if self._free_pages_after_evicting(grow):
                req.pages += self.allocator.alloc(grow)
                items.append((req, end))
                budget -= end - req.kv_len
            elif not items:
                return None  # wait for decodes to finish and free pages
        admitted = []
        if self.prefilling is None and self.waiting:
            policy = effective_policy(self.policy, len(self.waiting))
            for cand in candidates(list(self.waiting), self.cache, policy):
                if len(self.running) + len(items) >= self.max_running:
                    break
                if self.table.free_slots == 0 or budget <= 0:
                    break
                if policy == "lpm" and shares_uncached_prefix(cand, admitted):
                    continue
                req = cand.req
                # Match again: making room for earlier admissions may have evicted pages.
                match = None
                if cand.use_cache:
                    match = self.cache.match_prefix(req.tokens(match_limit(req)))
                prefix_pages = match.pages if match is not None else []
                start = len(prefix_pages) * self.page_size
                end = req.seq_len
                if end - start > budget:
                    # Prompt logprobs need every prompt position in one forward: never chunked.
                    if self.chunked_prefill and req.params.prompt_logprobs is None:
                        end = self._chunk_end(start, req, budget)
                        if end < req.seq_len and req.unverified:
                            # Earlier chunks give no logits to verify the jump: undo it.
                            self._unjump(req)
                            end = self._chunk_end(start, req, budget)
                    elif items:
                        break  # next step; a long prompt runs alone when chunking is off
                # Lock the match first so evicting to make room cannot take it.
                if match is not None:
                    self.cache.lock(match.node)
                grow = self.allocator.pages_for(end) - len(prefix_pages)
                fits = self._fits(grow, self.running + [r for r, _ in items] + [req])
                if not fits or not self._free_pages_after_evicting(grow):
                    if match is not None:
                        self.cache.unlock(match.node)
                    break
                self._admit(req, match.node if match else None, prefix_pages)
                req.pages += self.allocator.alloc(grow)
                self.waiting.remove(req)
                items.append((req, end))
                admitted.append(cand)
                budget -= end - req.kv_len
                if end < req.seq_len:
                    self.prefilling = req
                    break
        if not items:
            return None
        for req, end in items:
            self.stats.prefill_tokens_computed += end - req.kv_len
        self.stats.prefill_steps += 1
        return build_extend(items, self.allocator, self.table, self.device)

    def _jumped_items(self) -> list[tuple[Req, int]]:
        """Extend items computing the KV of jump-forward tokens; a request that cannot get the
        pages for them is retracted (it resumes later, output kept)."""
        items = []
        jumped, self.jumped = self.jumped, []
        for req in jumped:
            grow = self._pages_to_grow(req, req.seq_len)
            if self._free_pages_after_evicting(grow):
                req.pages += self.allocator.alloc(grow)
                items.append((req, req.seq_len))
            else:
                self._retract(req)
        return items

    def _chunk_end(self, start: int, req: Req, budget: int) -> int:
        """Where a prefill starting at `start` stops within `budget` tokens: the whole rest,
        or a chunk ending on a page boundary (so the next chunk starts on a fresh page)."""
        if req.seq_len - start <= budget:
            return req.seq_len
        aligned = (start + budget) // self.page_size * self.page_size
        return aligned if aligned > start else min(req.seq_len, start + self.page_size)

    def _pages_to_grow(self, req: Req, end: int) -> int:
        return max(0, self.allocator.pages_for(end) - len(req.pages))

    def _admit(self, req: Req, node, prefix_pages: list[int]) -> None:
        req.pool_row = self.table.alloc()
        req.cache_node = node
        req.pages = list(prefix_pages)
        req.shared_pages = len(prefix_pages)
        req.kv_len = len(prefix_pages) * self.page_size
        if prefix_pages:
            self.table.table[req.pool_row, : req.kv_len] = self._slots(prefix_pages)
        if not req.admitted_once:
            req.admitted_once = True
            req.cached_tokens = min(req.kv_len, req.prompt_len)
            self.stats.prompt_tokens += req.prompt_len
            self.stats.cached_prompt_tokens += req.cached_tokens

    def _slots(self, pages: list[int]) -> torch.Tensor:
        ps = self.page_size
        p = torch.tensor(pages, dtype=torch.int64)
        return (p[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1)

    # ---- decode ---------------------------------------------------------------------------
    def _schedule_decode(self, outs: list[TokenOut]) -> StepPlan | None:
        while self.running:
            need = sum(1 for r in self.running if r.kv_len % self.page_size == 0)
            if self._free_pages_after_evicting(need):
                break
            if self.prefilling is not None:
                self._retract(self.prefilling)  # its chunks must not starve running decodes
                continue
            if len(self.running) == 1:
                req = self.running[0]
                outs.append(
                    self._finish(
                        req,
                        "abort",
                        f"out of KV memory: the request needs {req.seq_len} tokens of KV and "
                        f"the pool holds {self.allocator.capacity_tokens}",
                    )
                )
                return None
            self._retract(self.running[-1])
        if not self.running:
            return None
        self._count_decode_step()
        return build_decode(list(self.running), self.allocator, self.table, self.device)

    def _admits_now(self) -> bool:
        """Whether a prefill step now would admit a waiting request: the first in policy
        order, the one `_schedule_prefill` tries first (it stops at the first that does not
        fit), with its cached prefix and, when chunking, only its first chunk. Under a backlog
        that must wait for KV, decode steps keep running ahead."""
        if not self.waiting or len(self.running) >= self.max_running:
            return False
        if self.table.free_slots == 0:
            return False
        policy = effective_policy(self.policy, len(self.waiting))
        # fcfs keeps arrival order: the head is the first candidate.
        considered = list(self.waiting) if policy == "lpm" else [self.waiting[0]]
        cand = candidates(considered, self.cache, policy)[0]
        req = cand.req
        cached = 0
        if cand.use_cache:
            cached = len(self.cache.match_prefix(req.tokens(match_limit(req))).pages)
        start = cached * self.page_size
        end = req.seq_len
        chunks = self.chunked_prefill and req.params.prompt_logprobs is None
        if end - start > self.prefill_budget and chunks:
            end = self._chunk_end(start, req, self.prefill_budget)
        return self._fits(self.allocator.pages_for(end) - cached, self.running + [req])

    def _fits(self, grow: int, decoding: list[Req]) -> bool:
        """Whether `grow` new pages fit in free and evictable pages with the decode reserve of
        `decoding` (the running requests plus those being admitted); a request admitted alone
        needs no reserve."""
        room = self.allocator.free_pages + self.cache.evictable_pages
        reserve = self._decode_reserve(decoding)
        return grow + reserve <= room or (len(decoding) == 1 and grow <= room)

    def _count_decode_step(self) -> None:
        self.stats.decode_steps += 1
        self._new_token_ratio = max(
            NEW_TOKEN_RATIO_MIN, self._new_token_ratio - NEW_TOKEN_RATIO_DECAY
        )

    def _retract(self, req: Req) -> None:
        """Free a running request's KV (into the cache) and queue it again, output kept."""
        self._release(req)
        req.retractions += 1
        self.stats.retractions += 1
        self.waiting.appendleft(req)
        # Admit more carefully for a while.
        self._new_token_ratio = min(1.0, max(self._new_token_ratio, NEW_TOKEN_RATIO_INIT) + 0.1)
        logger.debug("retracted %s at %d tokens", req.rid, req.seq_len)

    # ---- after the forward ----------------------------------------------------------------
    def _process(
        self, plan: StepPlan, result: SampleResult | None, logits: torch.Tensor | None
    ) -> list[TokenOut]:
        """Apply a step's samples. `logits` are needed only by an extend (jump verification,
        prompt logprobs); a decode's requests already count its KV (`_launch_decode`)."""
        prefilled = plan.batch.mode is ForwardMode.EXTEND
        if prefilled:
            for req, end in zip(plan.reqs, plan.ends):
                req.kv_len = end
            for req in plan.reqs:
                if self.prefilling is req and req.kv_len == req.seq_len:
                    self.prefilling = None
                if req.kv_len == req.seq_len and req not in self.running:
                    self.running.append(req)
        outs = []
        if result is not None:
            result = result.on_host()
            next_ids = result.next_ids.tolist()
            logprobs = token_logprobs(result) if result.logprobs is not None else None
            for i, req in enumerate(plan.sampling):
                if req.finished:
                    continue  # aborted, or stopped the step before this one ran ahead
                error = None
                if req.max_new_tokens == 0:
                    req.finish_reason = "length"  # prefill only: the sample is not kept
                else:
                    error = self._append_sample(req, next_ids[i], plan.last_rows[i], logits)
                out = self._out(req, req.take_unreported())
                out.error = error
                kept = req.max_new_tokens > 0
                if kept and logprobs is not None and req.params.logprobs is not None:
                    lp = logprobs[i]
                    lp.top = lp.top[: req.params.logprobs]
                    out.logprobs = [lp]
                if i in plan.prompt_rows and not req.prompt_logprobs_sent:
                    a, b = plan.prompt_rows[i]
                    out.prompt_logprobs = prompt_logprobs(req, logits[a:b])
                    req.prompt_logprobs_sent = True
                if req.finished:
                    self._release(req)
                    self.stats.finished_requests += 1
                outs.append(out)
        if prefilled:
            # Cache what was just computed, so requests admitted next step can share it.
            for req in plan.reqs:
                if req.pool_row is not None:
                    self._cache_unfinished(req)
        return outs

    def _append_sample(self, req: Req, tok: int, last_row: int, logits) -> str | None:
        """Append the token sampled for `req` (or the model's own token where it rejects
        jump-forward tokens), advance its grammar, check whether it finished, and jump forward;
        returns the error that failed it, if any."""
        if req.unverified:
            chosen = self._verify_jump(req, logits[last_row - req.unverified : last_row])
            tok = tok if chosen is None else chosen
        req.output_ids.append(tok)
        req.verified = len(req.output_ids)
        error = None
        if req.grammar is not None and tok not in self.eos_token_ids:
            try:
                req.grammar.advance(tok)
            except ValueError as e:
                req.finish_reason, error = "abort", f"grammar: {e}"
        if not req.finished:
            req.check_finished(tok)
        if req.grammar is not None and not req.finished:
            self._jump_forward(req)
        return error

    def _cache_unfinished(self, req: Req) -> None:
        full = req.kv_len // self.page_size
        if full <= req.shared_pages or isinstance(self.cache, NoPrefixCache):
            return
        tokens = req.tokens(full * self.page_size)
        duplicates = set(self.cache.insert(tokens, req.pages[:full]))
        match = self.cache.match_prefix(tokens)
        assert len(match.pages) == full, "an inserted prefix must match in full"
        self.cache.lock(match.node)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node = match.node
        if duplicates:
            # Another request cached the same tokens first: use its pages, free ours.
            changed = [i for i in range(full) if req.pages[i] != match.pages[i]]
            self.allocator.free([req.pages[i] for i in changed])
            for i in changed:
                req.pages[i] = match.pages[i]
            self.table.table[req.pool_row, : full * self.page_size] = self._slots(req.pages[:full])
        req.shared_pages = full

    def _release(self, req: Req, keep_kv: bool = True) -> None:
        """Give a request's KV back: whole pages to the prefix cache (which keeps what it did
        not already hold), the rest to the allocator; unlock its prefix; free its table row.
        With `keep_kv` False, nothing new goes to the cache."""
        if req in self.running:
            self.running.remove(req)
        if req in self.jumped:
            self.jumped.remove(req)
        if self.prefilling is req:
            self.prefilling = None
        full = min(req.kv_len // self.page_size, len(req.pages))
        if not keep_kv:
            full = req.shared_pages
        offered = req.pages[:full]
        duplicates = self.cache.insert(req.tokens(full * self.page_size), offered)
        own = set(req.pages[req.shared_pages :])
        self.allocator.free([p for p in duplicates if p in own] + req.pages[full:])
        if req.session_id is not None and req.finish_reason in ("stop", "length"):
            self.sessions.pin(req.session_id, req.tokens(full * self.page_size))
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.pages, req.shared_pages, req.cache_node, req.kv_len = [], 0, None, 0
        if req.pool_row is not None:
            self.table.free(req.pool_row)
            req.pool_row = None

    def close_session(self, session: str) -> bool:
        """Release `session`'s pin; whether it had one."""
        return self.sessions.close(session)

    def _finish(self, req: Req, reason: str, error: str | None = None) -> TokenOut:
        req.finish_reason = req.finish_reason or reason
        req.error = error
        if req.pool_row is not None or req.pages:
            self._release(req)
        if error:
            logger.warning("request %s failed: %s", req.rid, error)
        out = self._out(req, req.take_unreported())
        out.error = error
        return out

    # ---- grammars -------------------------------------------------------------------------
    def _grammar_mask(self, reqs: list[Req]) -> dict[str, torch.Tensor]:
        """The sampler's bitmask arguments for the constrained rows of `reqs` (none if none)."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return {}
        if self._bitmask is None:
            vocab = max(self.vocab_size, self.grammar_compiler.vocab.size)
            self._bitmask = BitmaskBuffer(vocab, self.device)
        mask, idx = self._bitmask.fill([reqs[i].grammar for i in rows], rows)
        return {"bitmask": mask, "bitmask_rows": idx}

    def _jump_forward(self, req: Req) -> None:
        """Append the tokens `req`'s grammar forces next (see `jump_tokens`) without sampling
        them; a running request then leaves `running` until an extend computes their KV. No
        jumps for requests that want logprobs (forced tokens have no sampled logprobs).

        The model might spell the forced text in other tokens (`c`, `ust` rather than `cust`)
        and then continue differently. For a greedy request, whose text must not depend on
        jump-forward, the tokens are a guess: unverified, not reported, until the extend's
        logits confirm them (`_verify_jump`). A sampled request keeps them at once: its text is
        random anyway, and every token stays allowed by the grammar."""
        p = req.params
        if not self.jump_forward or p.logprobs is not None or p.prompt_logprobs is not None:
            return
        room = req.remaining_new_tokens - 1
        forced = jump_tokens(req.grammar.forced_tokens(), room, p.stop_token_ids)
        if not forced:
            return
        for t in forced:
            req.grammar.advance(t)
        req.output_ids.extend(forced)
        if not p.greedy:
            req.verified = len(req.output_ids)
        self.stats.jump_forward_tokens += len(forced)
        if req in self.running:
            self.running.remove(req)
            self.jumped.append(req)

    def _verify_jump(self, req: Req, rows: torch.Tensor) -> int | None:
        """Check `req`'s unverified jump-forward tokens against `rows`, the extend's logits
        predicting each of them: the token greedy sampling (grammar mask, bias, penalties)
        picks at each is the next one, while they agree. Returns None if all agree. Otherwise
        drops the tokens from the first disagreement on (output, grammar state and KV: the
        pages past the kept tokens are freed, never cached) and returns the model's token
        there, which the caller appends as if sampled."""
        jumped = req.output_ids[req.verified :]
        n = len(jumped)
        grammar = req.grammar
        vocab = max(self.vocab_size, self.grammar_compiler.vocab.size)
        mask = torch.empty(n, bitmask_words(vocab), dtype=torch.int32)
        inputs = []
        grammar.rollback(n)
        for k, t in enumerate(jumped):
            grammar.fill_bitmask(mask[k])
            grammar.advance(t)
            before = req.output_ids[: req.verified + k]
            stops = req.sampling.stop_ids
            inputs.append(SamplingInput(req.params, req.seed, req.input_ids, before, stops))
        idx = torch.arange(n, device=self.device)
        chosen = self.sampler.sample(
            rows, inputs, bitmask=mask.to(self.device), bitmask_rows=idx
        ).next_ids.tolist()
        k = next((k for k in range(n) if chosen[k] != jumped[k]), None)
        if k is None:
            return None
        grammar.rollback(n - k)
        del req.output_ids[req.verified + k :]
        self.stats.jump_forward_rejected += n - k
        req.kv_len = req.seq_len
        keep = self.allocator.pages_for(req.kv_len)
        assert keep >= req.shared_pages, "unverified tokens are never cached"
        self.allocator.free(req.pages[keep:])
        del req.pages[keep:]
        return chosen[k]

    def _unjump(self, req: Req) -> None:
        """Drop the unverified jump-forward tokens of `req`, which has no KV for them."""
        assert req.kv_len <= req.prompt_len + req.verified
        req.grammar.rollback(req.unverified)
        del req.output_ids[req.verified :]

    def _out(self, req: Req, new_ids: list[int]) -> TokenOut:
        out = TokenOut(
            rid=req.rid,
            new_token_ids=new_ids,
            prompt_tokens=req.prompt_len,
            cached_tokens=req.cached_tokens,
            finish_reason=req.finish_reason,
            stop_token=req.stop_token,
        )
        if not req.detok_sent:
            req.detok_sent = True
            p = req.params
            out.detok = DetokSpec(
                prompt_tail=req.input_ids[-CONTEXT_TOKENS:],
                skip_special_tokens=p.skip_special_tokens,
                stop=list(p.stop),
                include_stop_str_in_output=p.include_stop_str_in_output,
                min_tokens=p.min_tokens,
                stop_regex=list(p.stop_regex),
            )
        return out

    # ---- control --------------------------------------------------------------------------
    def abort_all(self) -> list[TokenOut]:
        """Abort every request (after a failed forward, or at shutdown)."""
        reqs = list(self.waiting) + self.running + ([self.prefilling] if self.prefilling else [])
        reqs += self.jumped + list(self.grammar_waiting)
        return [o for req in reqs for o in self._abort(req.rid)]

    def control(self, op: str, arg: str | None = None) -> dict[str, float]:
        """Answer an operator request ("stats", "flush_cache", "check_invariants",
        "close_session" with the session id in `arg`); raises `ValueError` for an unknown op
        and `AssertionError` when invariants fail."""
        if op == "close_session":
            if not arg:
                raise ValueError("close_session: needs a session id")
            return {"closed": float(self.close_session(arg))}
        if op == "stats":
            return self.stats.as_dict() | self.usage()
        if op == "flush_cache":
            return {"flushed": float(self.flush_cache())}
        if op == "check_invariants":
            self.check_invariants()
            return {}
        raise ValueError(f"unknown control op {op!r}")

    def usage(self) -> dict[str, float]:
        cap = self.allocator.capacity_pages
        used = cap - self.allocator.free_pages - self.cache.evictable_pages
        return {
            "running_requests": float(
                len(self.running) + len(self.jumped) + (self.prefilling is not None)
            ),
            "queued_requests": float(len(self.waiting) + len(self.grammar_waiting)),
            "kv_capacity_tokens": float(self.allocator.capacity_tokens),
            "kv_free_tokens": float(self.allocator.free_pages * self.page_size),
            "kv_cached_tokens": float(self.cache.total_pages * self.page_size),
            "kv_usage": used / cap,
            "pinned_sessions": float(len(self.sessions)),
            "pinned_tokens": float(self.sessions.pinned_pages * self.page_size),
        }

    def flush_cache(self) -> bool:
        """Empty the prefix cache. Only when nothing runs; returns whether it flushed."""
        if self.running or self.prefilling or self.jumped:
            return False
        self.sessions.close_all()
        self.stats.evicted_tokens += self.cache.total_pages * self.page_size
        self.cache.reset()
        return True

    # ---- accounting -----------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Every KV page is free, held by exactly one active request, or held by the cache;
        every cache lock is held by exactly one active request's prefix."""
        self.cache.check_invariants()
        active = self.running + self.jumped + ([self.prefilling] if self.prefilling else [])
        assert self.prefilling is None or self.prefilling not in self.running
        assert not set(map(id, self.jumped)) & set(map(id, self.running)), "jumped yet running"
        free = self.allocator.free_page_set()
        assert len(free) == self.allocator.free_pages, "a page is on the free list twice"
        owned = [p for r in active for p in r.pages[r.shared_pages :]]
        cached = self.cache.cached_pages() if isinstance(self.cache, RadixCache) else []
        everything = list(free) + owned + cached
        assert len(everything) == len(set(everything)), "a KV page has two owners"
        assert len(everything) == self.allocator.capacity_pages, (
            f"KV pages leaked: free {len(free)} + requests {len(owned)} + cache {len(cached)} "
            f"!= capacity {self.allocator.capacity_pages}"
        )
        cached_set = set(cached)
        for r in active:
            assert set(r.pages[: r.shared_pages]) <= cached_set, "shared page not in the cache"
            assert len(r.pages) == self.allocator.pages_for(r.kv_len), "pages != kv length"
        # Lock counts: each active request with a cache node, and each pinned program
        # session, holds one lock on its path.
        if isinstance(self.cache, RadixCache):
            expected: dict[int, int] = {}
            for node in [r.cache_node for r in active] + self.sessions.nodes():
                while node is not None and node is not self.cache.root:
                    expected[id(node)] = expected.get(id(node), 0) + 1
                    node = node.parent
            for node in self.cache._nodes():
                assert node.lock_ref == expected.get(id(node), 0), "lock count off"
        rows = [r.pool_row for r in active]
        assert None not in rows and len(set(rows)) == len(rows)
        assert self.table.free_slots + len(rows) == self.table.size, "table rows leaked"
        assert all(r.pool_row is None and not r.pages for r in self.waiting)
        assert all(r.pool_row is None and not r.pages for r in self.grammar_waiting)


def _no_tokenizer() -> GrammarCompiler:
    raise ValueError("json_schema/regex/choice: this model has no tokenizer")
