"""The scheduler: continuous batching over the paged KV pool.

Its interface is message-shaped, so it can run in its own process: `handle()` takes a
`GenerateReq` or `AbortReq`, `step()` runs one forward and returns `TokenOut`s. Each step either
prefills newly admitted requests (they then join the running batch) or decodes one token for
every running request. Admission reserves each request's whole KV budget (prompt plus
`max_new_tokens`), so a running request never runs out of slots.
"""

from __future__ import annotations

import logging
from collections import deque

import torch

from braid.runtime.executor.model_runner import ModelRunner
from braid.runtime.executor.sampler import Sampler, SampleResult
from braid.runtime.ipc.to_detokenizer import TokenLogprob, TokenOut
from braid.runtime.ipc.to_scheduler import AbortReq, GenerateReq
from braid.runtime.scheduler.batch import StepPlan, build_decode, build_extend
from braid.runtime.scheduler.request import Req

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        eos_token_ids: frozenset[int],
        max_prefill_tokens: int,
    ) -> None:
        self.runner = runner
        self.allocator = runner.kv_pool.allocator
        self.table = runner.req_to_token
        self.device = runner.device
        self.vocab_size = runner.model_config.vocab_size
        self.sampler = Sampler(self.vocab_size, self.device)
        self.eos_token_ids = eos_token_ids
        self.max_prefill_tokens = max_prefill_tokens
        self.max_running = runner.max_running_requests
        self.context_length = runner.context_length
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []

    # ---- messages in ------------------------------------------------------------------
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
        )
        need = self.allocator.pages_for(n + max_new)
        if need > self.allocator.capacity_pages:
            raise ValueError(
                f"max_tokens: the request needs {n + max_new} KV tokens but the pool holds "
                f"{self.allocator.capacity_tokens}; lower max_tokens or raise kv_tokens"
            )
        self.waiting.append(req)

    def _abort(self, rid: str) -> list[TokenOut]:
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                req.finish_reason = "abort"
                return [self._out(req, [])]
        for req in self.running:
            if req.rid == rid:
                req.finish_reason = "abort"
                self._release(req)
                return [self._out(req, [])]
        return []

    # ---- the step -----------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[TokenOut]:
        """Run one forward (a prefill of admitted requests, else a decode of the running ones)
        and return what each request in it gained."""
        plan = self._schedule()
        if plan is None:
            return []
        logits = self.runner.forward(plan.batch)
        last = logits[plan.last_rows] if len(plan.last_rows) != logits.shape[0] else logits
        result = self.sampler.sample(last, [r.sampling for r in plan.reqs])
        return self._process(plan, result, logits)

    def _schedule(self) -> StepPlan | None:
        admitted = self._admit()
        if admitted:
            return build_extend(admitted, self.allocator, self.table, self.device)
        if self.running:
            return build_decode(list(self.running), self.allocator, self.table, self.device)
        return None

    def _admit(self) -> list[Req]:
        admitted: list[Req] = []
        tokens = 0
        # Pages promised to running requests but not yet taken from the pool.
        promised = sum(r.reserved_pages - len(r.pages) for r in self.running)
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            need = self.allocator.pages_for(req.prompt_len + req.max_new_tokens)
            if promised + need > self.allocator.free_pages:
                break
            if admitted and tokens + req.prompt_len > self.max_prefill_tokens:
                break
            if self.table.free_slots == 0:
                break
            self.waiting.popleft()
            req.pool_row = self.table.alloc()
            req.reserved_pages = need
            promised += need
            tokens += req.prompt_len
            admitted.append(req)
            self.running.append(req)
        return admitted

    def _process(
        self, plan: StepPlan, result: SampleResult, logits: torch.Tensor
    ) -> list[TokenOut]:
        next_ids = result.next_ids.tolist()
        logprobs = self._token_logprobs(result) if result.logprobs is not None else None
        outs = []
        for i, req in enumerate(plan.reqs):
            req.kv_len = req.seq_len  # every token up to the last sampled one now has KV
            tok = next_ids[i]
            req.output_ids.append(tok)
            req.check_finished(tok)
            out = self._out(req, [tok])
            if logprobs is not None and req.params.logprobs is not None:
                lp = logprobs[i]
                lp.top = lp.top[: req.params.logprobs]
                out.logprobs = [lp]
            if i in plan.prompt_rows:
                a, b = plan.prompt_rows[i]
                out.prompt_logprobs = self._prompt_logprobs(req, logits[a:b])
            if req.finished:
                self._release(req)
            outs.append(out)
        return outs

    def _token_logprobs(self, result: SampleResult) -> list[TokenLogprob]:
        ids = result.next_ids.tolist()
        lps = result.logprobs.tolist()
        ranks = result.ranks.tolist()
        tops = (
            list(zip(result.top_ids.tolist(), result.top_logprobs.tolist()))
            if result.top_ids is not None
            else [([], [])] * len(ids)
        )
        return [
            TokenLogprob(t, lp, rk, list(zip(ti, tl)))
            for t, lp, rk, (ti, tl) in zip(ids, lps, ranks, tops)
        ]

    def _prompt_logprobs(self, req: Req, rows: torch.Tensor) -> list[TokenLogprob | None]:
        """Log-probabilities of prompt tokens 1..n-1 from the logits at positions 0..n-2."""
        k = req.params.prompt_logprobs
        lp = torch.log_softmax(rows[:-1], dim=-1)
        targets = torch.tensor(req.input_ids[1:], device=lp.device)
        chosen = lp.gather(1, targets[:, None])
        ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
        top = lp.topk(k, dim=-1) if k else None
        out: list[TokenLogprob | None] = [None]
        for j, (t, c) in enumerate(zip(req.input_ids[1:], chosen[:, 0].tolist())):
            alts = list(zip(top.indices[j].tolist(), top.values[j].tolist())) if top else []
            out.append(TokenLogprob(t, c, ranks[j], alts))
        return out

    def _out(self, req: Req, new_ids: list[int]) -> TokenOut:
        return TokenOut(
            rid=req.rid,
            new_token_ids=new_ids,
            prompt_tokens=req.prompt_len,
            cached_tokens=req.cached_tokens,
            finish_reason=req.finish_reason,
            stop_token=req.stop_token,
        )

    def _release(self, req: Req) -> None:
        """Return a finished or aborted request's KV pages, budget and table row."""
        self.running.remove(req)
        self.allocator.free(req.pages)
        req.pages = []
        req.reserved_pages = 0
        if req.pool_row is not None:
            self.table.free(req.pool_row)
            req.pool_row = None

    def abort_all(self, reason: str = "abort") -> list[TokenOut]:
        """Abort every request (after a failed forward, or at shutdown)."""
        outs = []
        for req in list(self.waiting) + list(self.running):
            outs += self._abort(req.rid)
        return outs

    # ---- accounting -------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Every KV page is free or held by exactly one running request; budgets add up."""
        free = self.allocator.free_page_set()
        held: list[int] = [p for r in self.running for p in r.pages]
        assert len(held) == len(set(held)), "a KV page is held by two requests"
        assert not free & set(held), "a KV page is both free and held"
        assert len(free) == self.allocator.free_pages, "a page is on the free list twice"
        assert len(free) + len(held) == self.allocator.capacity_pages, (
            f"KV pages leaked: free {len(free)} + held {len(held)} != "
            f"capacity {self.allocator.capacity_pages}"
        )
        promised = sum(r.reserved_pages - len(r.pages) for r in self.running)
        assert all(len(r.pages) <= r.reserved_pages for r in self.running), "over budget"
        assert promised <= len(free), "more pages promised than free"
        rows = [r.pool_row for r in self.running]
        assert None not in rows and len(set(rows)) == len(rows)
        assert self.table.free_slots + len(rows) == self.table.size, "table rows leaked"
        assert all(r.pool_row is None and not r.pages for r in self.waiting)
