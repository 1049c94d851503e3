"""After the forward: turning a step's samples into requests' tokens and `TokenOut`s, verifying
jump-forward tokens, caching what a prefill computed, and finishing requests."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from braid.runtime.constrained.manager import GrammarManager
from braid.runtime.executor.executor import Executor
from braid.runtime.executor.sampler import SampleResult, SamplingInput
from braid.runtime.forward_batch import ForwardMode
from braid.runtime.ipc.to_detokenizer import CONTEXT_TOKENS, DetokSpec, SpecUsage, TokenOut
from braid.runtime.pooling import finish_vector, to_wire
from braid.runtime.scheduler.batch import StepPlan
from braid.runtime.scheduler.kv import KVManager
from braid.runtime.scheduler.logprobs import prompt_logprobs, token_logprobs
from braid.runtime.scheduler.request import Req, ReqStatus, RequestTable
from braid.runtime.scheduler.stats import SchedulerStats
from braid.runtime.scheduler.verify import VerifyPlan
from braid.runtime.speculative.base import Proposer

logger = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(
        self,
        reqs: RequestTable,
        kv: KVManager,
        grammars: GrammarManager,
        executor: Executor,
        stats: SchedulerStats,
        eos_token_ids: frozenset[int],
        speculative: bool = False,
    ) -> None:
        self.reqs = reqs
        self.kv = kv
        self.grammars = grammars
        self.executor = executor
        self.stats = stats
        self.eos_token_ids = eos_token_ids
        self.speculative = speculative  # finished requests report `SpecUsage`

    def process(
        self,
        plan: StepPlan,
        result: SampleResult | None,
        logits: torch.Tensor | None,
        dropped: frozenset[int] = frozenset(),
        on_advanced: Callable[[], bool] | None = None,
    ) -> list[TokenOut]:
        """Apply a step's samples. `logits` are needed only by an extend (jump verification,
        prompt logprobs); a decode's requests already count its KV (from its launch). The
        rows of requests whose `id` is in `dropped` are skipped (see `overlap.Launched`).
        `on_advanced` runs once the grammars have taken their tokens; if it says a mask fill
        started (`GrammarManager.start_fill`), jump-forward waits for that fill to end."""
        prefilled = plan.batch.mode is ForwardMode.EXTEND
        if prefilled:
            for req, end in zip(plan.reqs, plan.ends):
                req.kv_len = end
                if req.embed is not None:
                    continue  # pooled below; it never runs
                if end == req.seq_len and req.status in (ReqStatus.PREFILLING, ReqStatus.JUMPED):
                    self.reqs.move(req, ReqStatus.RUNNING)
        outs = self._pool(plan) if plan.pooling else []
        if result is not None:
            t0 = time.perf_counter()
            result = result.on_host()
            self.stats.readback_wait_seconds += time.perf_counter() - t0
            next_ids = result.next_ids.tolist()
            logprobs = token_logprobs(result) if result.logprobs is not None else None
            advanced = self._advance_grammars(plan.sampling, next_ids, dropped)
            jumps: list[Req] | None = [] if on_advanced is not None and on_advanced() else None
            for i, req in enumerate(plan.sampling):
                if req.finished or id(req) in dropped:
                    continue  # aborted, or stopped or jumped the step before this ran ahead
                error = None
                if req.max_new_tokens == 0:
                    req.finish_reason = "length"  # prefill only: the sample is not kept
                else:
                    error = self._append_sample(
                        req,
                        next_ids[i],
                        plan.last_rows[i],
                        logits,
                        i in advanced,
                        advanced.get(i),
                        jumps,
                    )
                out = self.token_out(req, req.take_unreported())
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
                    self.kv.release(req)
                    self.reqs.discard(req)
                    self.stats.finished_requests += 1
                outs.append(out)
            if jumps is not None:
                self.grammars.settle()
                for req in jumps:  # reported with their next tokens
                    self.jump_forward(req)
        if prefilled:
            # Cache what was just computed, so requests admitted next step can share it (a
            # mixed step's decode rows are cached as a decode step's are: when they finish).
            for req in plan.prefilled:
                if req.pool_row is not None:
                    self.kv.cache_unfinished(req)
        return outs

    def _pool(self, plan: StepPlan) -> list[TokenOut]:
        """Feed each embedding request of an extend its rows' hidden states; one whose prompt
        is now computed finishes with its vector, and its KV goes as any finished request's
        does (whole pages to the prefix cache, evictable at once; the rest freed)."""
        hidden = plan.batch.hidden_states
        assert hidden is not None, "an extend with embedding requests must capture hidden states"
        outs, vectors = [], []
        for req, row, n in plan.pooling:
            if req.finished:
                continue
            req.pooled.add(req.kv_len - n, hidden[row : row + n])
            if req.kv_len < req.seq_len:
                continue  # a chunk of a longer prompt
            req.finish_reason = "stop"
            outs.append(self.token_out(req, []))
            vectors.append(finish_vector(req.pooled.result(), req.embed))
            req.pooled = None
            self.kv.release(req)
            self.reqs.discard(req)
            self.stats.finished_requests += 1
            self.stats.embedding_requests += 1
        for out, data in zip(outs, to_wire(vectors)):
            out.embedding = data
        return outs

    def process_verify(
        self, plan: VerifyPlan, result: SampleResult, proposer: Proposer
    ) -> list[TokenOut]:
        """Apply a verify step: from each request's last token, follow the draft node whose
        token is the target's sample at its parent's row, then keep the target's sample after
        the last node followed; the tokens are appended one by one until one finishes the
        request. The KV of the nodes kept ends up at their positions (a tree's is moved
        there); the rest is freed, never cached, and only the drafts kept are charged to the
        request's program. `plan.kept_rows` records each request's rows whose KV it kept."""
        result = result.on_host()
        ids = result.next_ids.tolist()
        logprobs = token_logprobs(result) if result.logprobs is not None else None
        stats = self.stats
        stats.spec_verify_steps += 1
        moves: list[tuple[Req, int, list[int]]] = []
        plan.kept_rows = [[] for _ in plan.reqs]
        walked = []  # (i, rows sampled, accepted, kept, error) of each request processed
        for i, (req, tree, first) in enumerate(zip(plan.reqs, plan.drafts, plan.first_rows)):
            if req.finished:
                continue
            path, node, row = [], -1, first
            while (child := tree.children.get(node, {}).get(ids[row])) is not None:
                path.append(child)
                node, row = child, first + 1 + child
            kept, error = 0, None
            for tok in [*(tree.tokens[n] for n in path), ids[row]]:
                error = self._append_verified(req, tok)
                kept += 1
                if req.finished:
                    break
            held = min(kept, len(path))  # nodes whose KV is kept (not the token after them)
            if plan.tree_slots[i] and held:
                moves.append((req, plan.roots[i] + 1, [plan.tree_slots[i][n] for n in path[:held]]))
            rows = [first] + [first + 1 + n for n in path]  # the rows that sampled what is kept
            plan.kept_rows[i] = rows[: 1 + held]
            walked.append((i, rows, len(path), kept, error))
        if moves:
            self.kv.place(moves)  # before any of these requests' pages is cached
        for pages in plan.tree_pages:
            self.kv.allocator.free(pages)
        outs = []
        for i, rows, accepted, kept, error in walked:
            req, tree = plan.reqs[i], plan.drafts[i]
            self.kv.trim(req, plan.roots[i] + len(plan.kept_rows[i]))
            if self.reqs.programs is not None:  # the step's plan charged its last token's KV
                self.reqs.programs.serve(req, plan.roots[i] + 1, req.kv_len)
            req.spec_steps += 1
            req.spec_drafts += len(tree)
            req.spec_accepted += accepted
            stats.spec_request_steps += 1
            stats.spec_draft_tokens += len(tree)
            stats.spec_accepted_tokens += accepted
            stats.spec_emitted_tokens += kept
            proposer.verified(req, tree, accepted)
            if req.grammar is not None and not req.finished:
                self.jump_forward(req)
            out = self.token_out(req, req.take_unreported())
            out.error = error
            if logprobs is not None and req.params.logprobs is not None:
                out.logprobs = []
                for r in rows[:kept]:
                    lp = logprobs[r]
                    lp.top = lp.top[: req.params.logprobs]
                    out.logprobs.append(lp)
            if req.finished:
                self.kv.release(req)
                self.reqs.discard(req)
                stats.finished_requests += 1
            outs.append(out)
        return outs

    def _append_verified(self, req: Req, tok: int) -> str | None:
        """Append a token a verify step kept, advance the grammar over it and check whether it
        finished `req`; the grammar's error, if it refused the token (which fails `req`)."""
        req.output_ids.append(tok)
        req.verified = len(req.output_ids)
        if req.grammar is not None and tok not in self.eos_token_ids:
            try:
                req.grammar.advance(tok)
            except ValueError as e:
                req.finish_reason = "abort"
                return f"grammar: {self.grammars.refused(req, str(e))}"
        req.check_finished(tok)
        return None

    def _advance_grammars(
        self, reqs: list[Req], tokens: list[int], dropped: frozenset[int]
    ) -> dict[int, str | None]:
        """Advance, all at once, the grammars of the rows whose sampled token is the one they
        keep (no jump-forward tokens to verify, grammar already applying, not EOS): {row: the
        grammar's error or None}. `_append_sample` advances the others itself."""
        rows = [
            i
            for i, req in enumerate(reqs)
            if req.grammar is not None
            and not req.finished
            and id(req) not in dropped
            and req.max_new_tokens > 0
            and req.unverified == 0
            and tokens[i] not in self.eos_token_ids
        ]
        if not rows:
            return {}
        errors = self.grammars.advance([reqs[i] for i in rows], [tokens[i] for i in rows])
        return dict(zip(rows, errors))

    def _append_sample(
        self,
        req: Req,
        tok: int,
        last_row: int,
        logits: torch.Tensor | None,
        advanced: bool = False,
        grammar_error: str | None = None,
        jumps: list[Req] | None = None,
    ) -> str | None:
        """Append the token sampled for `req` (or the model's own token where it rejects
        jump-forward tokens), advance its grammar (unless `advanced`: done already, failing
        with `grammar_error` if that is set), check whether it finished, and jump forward
        (or add it to `jumps`, for the caller to jump later); returns the error that failed
        it, if any."""
        if req.unverified:
            rows = logits[last_row - req.unverified : last_row]
            chosen, rejected = self.grammars.verify(req, rows, self._greedy)
            if rejected:
                self.stats.jump_forward_rejected += rejected
                self.kv.trim(req)
            tok = tok if chosen is None else chosen
        req.output_ids.append(tok)
        req.verified = len(req.output_ids)
        req.decide_grammar()  # a first token that does not open the thinking is the grammar's
        error = None
        if advanced:
            if grammar_error is not None:
                req.finish_reason, error = "abort", f"grammar: {grammar_error}"
        elif req.grammar is not None and tok not in self.eos_token_ids:
            try:
                req.grammar.advance(tok)
            except ValueError as e:
                req.finish_reason, error = "abort", f"grammar: {self.grammars.refused(req, str(e))}"
        if not req.finished:
            req.check_finished(tok)
        req.release_grammar()  # the thinking just ended: the constraint applies from here
        if req.grammar is not None and not req.finished:
            if jumps is None:
                self.jump_forward(req)
            else:
                jumps.append(req)
        return error

    def _greedy(self, req: Req, rows: torch.Tensor, mask: torch.Tensor) -> list[int]:
        """The token sampling picks at each of `rows` (predicting `req`'s unverified tokens in
        turn) under the bitmask row of the same index."""
        n = rows.shape[0]
        stops = req.sampling.stop_ids
        inputs = [
            SamplingInput(
                req.params, req.seed, req.input_ids, req.output_ids[: req.verified + k], stops
            )
            for k in range(n)
        ]
        idx = torch.arange(n, device=self.executor.device)
        mask = mask.to(self.executor.device)
        return self.executor.sample(rows, inputs, bitmask=mask, bitmask_rows=idx).next_ids.tolist()

    def jump_forward(self, req: Req) -> None:
        """Jump `req` forward over the tokens its grammar forces; a running request then waits
        (JUMPED) for an extend to compute their KV."""
        forced = self.grammars.jump_forward(req)
        self.stats.jump_forward_tokens += forced
        if forced and req.status is ReqStatus.RUNNING:
            self.reqs.move(req, ReqStatus.JUMPED)

    def finish(self, req: Req, reason: str, error: str | None = None) -> TokenOut:
        """End `req` (if it has not ended) with `reason`, free its KV, and say so."""
        req.finish_reason = req.finish_reason or reason
        req.error = error
        self.kv.release(req)
        self.reqs.discard(req)
        if error:
            logger.warning("request %s failed: %s", req.rid, error)
        out = self.token_out(req, req.take_unreported())
        out.error = error
        return out

    def token_out(self, req: Req, new_ids: list[int]) -> TokenOut:
        out = TokenOut(
            rid=req.rid,
            new_token_ids=new_ids,
            prompt_tokens=req.prompt_len,
            cached_tokens=req.cached_tokens,
            finish_reason=req.finish_reason,
            stop_token=req.stop_token,
        )
        if self.speculative and req.finished:
            out.spec = SpecUsage(req.spec_steps, req.spec_drafts, req.spec_accepted)
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
