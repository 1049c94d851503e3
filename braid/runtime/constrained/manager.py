"""The scheduler's grammar side: requests waiting for their grammar to compile, the bitmasks of
a batch's constrained rows, and jump-forward (tokens a grammar forces, appended without
sampling) with its verification and roll-back.

It works on any request object with the attributes of `Constrained`; request statuses and KV
stay with the scheduler, which is told what happened (how many tokens were forced, which were
rejected) and acts on it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from braid.runtime.constrained.bitmask import BitmaskBuffer, apply_token_bitmask, bitmask_words
from braid.runtime.constrained.compile_pool import AsyncGrammarCompiler, PendingGrammars
from braid.runtime.constrained.grammar import GrammarCompiler, GrammarMatcher, short_error
from braid.runtime.constrained.jump_forward import jump_tokens

logger = logging.getLogger(__name__)

# Picks the next token at each row of the logits given, under the bitmask row of the same index
# (greedy sampling with the request's bias and penalties); gets the request too.
Choose = Callable[[Any, torch.Tensor, torch.Tensor], list[int]]


class Constrained(Protocol):
    """What the grammar manager reads and changes on a request."""

    rid: str
    params: Any  # SamplingParams: logprobs, prompt_logprobs, greedy, stop_token_ids
    grammar: GrammarMatcher | None
    output_ids: list[int]
    verified: int
    waiting_grammar: GrammarMatcher | None  # compiled, waiting for the end of thinking
    grammar_open: int | None  # the token that may open the thinking first

    @property
    def grammar_undecided(self) -> bool: ...

    @property
    def remaining_new_tokens(self) -> int: ...

    @property
    def unverified(self) -> int: ...


@dataclass(frozen=True)
class _EarlyFill:
    """A fill running in the mask thread: the masks of `reqs[i]` for i in `rows`, at buffer
    positions 0, 1, ... in that order."""

    reqs: list[Any]
    rows: list[int]
    done: Future


class GrammarManager:
    def __init__(
        self,
        compiler: AsyncGrammarCompiler | Callable[[], GrammarCompiler] | None,
        compile_timeout_s: float,
        vocab_size: int,
        device: torch.device,
        jump_forward: bool,
    ) -> None:
        """`compiler`: the compile pool, or what builds the pool's `GrammarCompiler`; None for
        a model without a tokenizer."""
        self.has_tokenizer = compiler is not None
        if not isinstance(compiler, AsyncGrammarCompiler):
            compiler = AsyncGrammarCompiler(compiler or _no_tokenizer)
        self.waiting: PendingGrammars[Constrained] = PendingGrammars(compiler, compile_timeout_s)
        self.vocab_size = vocab_size
        self.device = device
        self.jump_forward_enabled = jump_forward
        self._bitmask: BitmaskBuffer | None = None
        # Host time spent writing bitmask rows, and the rows written (the mask's cost per
        # constrained token); of those, the rows the mask thread wrote (`start_fill`), and how
        # long the scheduler's thread waited for it. Time spent advancing grammars in batch.
        self.mask_seconds = 0.0
        self.masked_rows = 0
        self.early_rows = 0
        self.wait_seconds = 0.0
        self.advance_seconds = 0.0
        self.fill_early = True  # `start_fill` may start fills (off: disable_grammar_mask_thread)
        self._thread: ThreadPoolExecutor | None = None
        self._early: _EarlyFill | None = None

    @property
    def compiler(self) -> GrammarCompiler | None:
        """The grammar compiler, once the first constrained request has built it."""
        return self.waiting.compiler.compiler

    @property
    def _vocab(self) -> int:
        return max(self.vocab_size, self.compiler.vocab.size)

    # ---- compiling ------------------------------------------------------------------------
    def add(self, req: Constrained, kind: str, spec: Any) -> None:
        """Start compiling `req`'s grammar; a model without a tokenizer is a `ValueError`."""
        if not self.has_tokenizer:
            raise ValueError("json_schema/regex/choice: this model has no tokenizer")
        self.waiting.add(req, kind, spec)

    def poll(self) -> tuple[list[Constrained], list[tuple[Constrained, str]]]:
        """The requests whose grammar is ready, each given its matcher, and those whose
        grammar failed to compile, ran out of time, or admits no output (its
        `CompiledGrammar.unsatisfiable`: refused before it runs, as a compile error is), each
        with the error."""
        if not len(self.waiting):
            return [], []
        ready, failed = self.waiting.poll()
        admitted = []
        for req, grammar in ready:
            if grammar.unsatisfiable is not None:
                failed.append((req, grammar.unsatisfiable))
                continue
            req.grammar = grammar.matcher()
            admitted.append(req)
        return admitted, failed

    def remove(self, req: Constrained) -> None:
        self.waiting.remove(req)

    def clear(self) -> list[Constrained]:
        return self.waiting.clear()

    def wait(self, timeout_s: float) -> None:
        """Block up to `timeout_s` for a grammar to finish compiling."""
        self.waiting.wait(timeout_s)

    def __len__(self) -> int:
        return len(self.waiting)

    def __iter__(self) -> Iterator[Constrained]:
        return iter(self.waiting)

    # ---- masks ----------------------------------------------------------------------------
    def warm(self) -> None:
        """Get the mask path ready at start rather than in the first constrained request:
        the compiler threads build the vocabulary and start a worker in the background, and on
        a GPU a bitmask is applied once (the kernel's Triton JIT). On the CPU nothing is
        warmed: tests and small machines start many engines that never constrain."""
        if self.device.type == "cpu":
            return
        if self.has_tokenizer:
            self.waiting.compiler.start()
        logits = torch.zeros(1, self.vocab_size, dtype=torch.float32, device=self.device)
        words = bitmask_words(self.vocab_size)
        mask = torch.full((1, words), -1, dtype=torch.int32, device=self.device)
        apply_token_bitmask(logits, mask, torch.zeros(1, dtype=torch.int64, device=self.device))

    def mask(self, reqs: list[Constrained | None]) -> dict[str, torch.Tensor]:
        """The sampler's bitmask arguments for the constrained rows of `reqs` (none if none);
        a None row is left unmasked (its sample is dropped), unless the mask thread filled it
        for these requests (`start_fill`): its mask is sent as filled, harmless on a sample
        that is dropped. A request whose first token decides whether its grammar waits for the
        end of thinking (`grammar_undecided`) may take the grammar's tokens or the one that
        opens the thinking."""
        early = self._take_early(reqs)
        rows = list(early.rows) if early is not None else []
        done = set(rows)  # rows the mask thread wrote, at the buffer's first positions
        matchers, extra = [], []
        for i, r in enumerate(reqs):
            if r is None or i in done:
                continue
            if r.grammar is not None:
                rows.append(i)
                matchers.append(r.grammar)
            elif r.grammar_undecided:
                extra.append((len(rows), r.grammar_open))
                rows.append(i)
                matchers.append(r.waiting_grammar)
        if not rows:
            return {}
        t0 = time.perf_counter()
        buf = self._buffer()
        if early is None:
            mask, idx = buf.fill(matchers, rows, extra)
        else:
            buf.rows(len(rows))  # already as large: `start_fill` made room for every row
            buf.write(matchers, range(len(done), len(rows)))
            buf.allow(extra)
            mask, idx = buf.send(len(rows), rows)
        self.mask_seconds += time.perf_counter() - t0
        self.masked_rows += len(rows)
        return {"bitmask": mask, "bitmask_rows": idx}

    def start_fill(self, reqs: list[Constrained]) -> bool:
        """Start writing, in the mask thread, the mask rows of `reqs` (the requests of a step
        queued ahead, whose grammars have taken the step before's tokens) whose grammar
        applies and stays (no grammar waiting for the end of thinking), if their backend
        fills them natively (`GrammarMatcher.fills_natively`: the others are filled in `mask`,
        with the rest); the scheduler's thread goes on
        with the step before's tokens meanwhile. Until `settle`, nothing may use those
        matchers (jump-forward waits). `mask(reqs)`, with a row None where its sample will
        be dropped, sends these rows with the rest. Whether a fill started."""
        if not self.fill_early or self._early is not None:
            return False
        settled = [
            i for i, r in enumerate(reqs) if r.grammar is not None and r.waiting_grammar is None
        ]
        count: dict[type, int] = {}
        for i in settled:
            count[type(reqs[i].grammar)] = count.get(type(reqs[i].grammar), 0) + 1
        rows = [
            i for i in settled if type(reqs[i].grammar).fills_natively(count[type(reqs[i].grammar)])
        ]
        if not rows:
            return False
        matchers = [reqs[i].grammar for i in rows]
        buf = self._buffer()
        buf.rows(len(reqs))
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="braid-masks")
        done = self._thread.submit(self._write, buf, matchers)
        self._early = _EarlyFill(list(reqs), rows, done)
        self.early_rows += len(rows)
        return True

    def settle(self) -> None:
        """Wait for the fill `start_fill` started, if any (raising what it raised)."""
        if self._early is not None:
            self._wait(self._early)

    def _write(self, buf: BitmaskBuffer, matchers: list[GrammarMatcher]) -> None:
        t0 = time.perf_counter()
        buf.write(matchers, range(len(matchers)))
        self.mask_seconds += time.perf_counter() - t0

    def _take_early(self, reqs: list[Constrained | None]) -> _EarlyFill | None:
        """The fill `start_fill` started, finished, if it was for `reqs` (the same request at
        every row, or None); one for other requests is waited for and dropped."""
        early, self._early = self._early, None
        if early is None:
            return None
        self._wait(early)
        same = len(reqs) == len(early.reqs) and all(
            r is None or r is e for r, e in zip(reqs, early.reqs)
        )
        return early if same else None

    def _wait(self, early: _EarlyFill) -> None:
        t0 = time.perf_counter()
        early.done.result()
        self.wait_seconds += time.perf_counter() - t0

    def _buffer(self) -> BitmaskBuffer:
        if self._bitmask is None:
            self._bitmask = BitmaskBuffer(bitmask_words(self.compiler.vocab.size), self.device)
        return self._bitmask

    def mask_drafts(
        self,
        reqs: list[Constrained],
        drafts: list[Any],
        first_rows: list[int],
        eos_ids: frozenset[int],
    ) -> dict[str, torch.Tensor]:
        """The bitmask arguments of a verify step (see `scheduler/verify.py`; `drafts` are
        `DraftTree`s): for each constrained request, the row of draft node n gets the grammar's
        mask after the tokens of n's branch (an EOS moves no grammar, as a sampled EOS does
        not). A node whose token its parent's mask refuses is never kept (the target's sample
        there cannot be it): its row, and its descendants', repeat the parent's mask."""
        todo = [(r, d, f) for r, d, f in zip(reqs, drafts, first_rows) if r.grammar is not None]
        if not todo:
            return {}
        self._take_early([])  # none is started for a verify step; the buffer is free
        t0 = time.perf_counter()
        n = sum(1 + len(d) for _, d, _ in todo)
        buf = self._buffer().rows(n)
        rows: list[int] = []
        for req, tree, first in todo:
            base = len(rows)
            rows += range(first, first + 1 + len(tree))
            if tree.is_chain:
                _fill_chain(req.grammar, tree.tokens, buf[base:], eos_ids)
            else:
                _fill_tree(req.grammar, tree, buf[base:], eos_ids)
        self.mask_seconds += time.perf_counter() - t0
        self.masked_rows += n
        mask, idx = self._buffer().send(n, rows)
        return {"bitmask": mask, "bitmask_rows": idx}

    def advance(self, reqs: list[Constrained], tokens: list[int]) -> list[str | None]:
        """Advance each request's grammar by its sampled token, those of one backend together
        (`GrammarMatcher.advance_many`); the error of each whose grammar refused it, else
        None."""
        t0 = time.perf_counter()
        errors: list[str | None] = [None] * len(reqs)
        by_class: dict[type, list[int]] = {}
        for i, r in enumerate(reqs):
            by_class.setdefault(type(r.grammar), []).append(i)
        for cls, idx in by_class.items():
            got = cls.advance_many([reqs[i].grammar for i in idx], [tokens[i] for i in idx])
            for i, e in zip(idx, got):
                errors[i] = None if e is None else self.refused(reqs[i], e)
        self.advance_seconds += time.perf_counter() - t0
        return errors

    def refused(self, req: Constrained, error: str) -> str:
        """What `req`, whose grammar refused its sampled token mid-generation with `error` (the
        matcher's, which may be long), is failed with: `error` on one line, at most
        `MAX_ERROR_CHARS`. Logs it, one line, for the operator."""
        short = short_error(error)
        kind = req.grammar.grammar.kind if req.grammar is not None else "constraint"
        logger.warning("request %s: its %s grammar failed mid-generation: %s", req.rid, kind, short)
        return short

    def counters(self) -> dict[str, float]:
        return {
            "grammar_mask_seconds": self.mask_seconds,
            "grammar_masked_rows": self.masked_rows,
            "grammar_early_rows": self.early_rows,
            "grammar_wait_seconds": self.wait_seconds,
            "grammar_advance_seconds": self.advance_seconds,
        }

    # ---- jump-forward ---------------------------------------------------------------------
    def jump_forward(self, req: Constrained) -> int:
        """Append the tokens `req`'s grammar forces next (see `jump_tokens`) without sampling
        them; returns how many (a running request that got some needs an extend to compute
        their KV before it decodes again). No jumps for requests that want logprobs (forced
        tokens have no sampled logprobs).

        The model might spell the forced text in other tokens (`c`, `ust` rather than `cust`)
        and then continue differently. For a greedy request, whose text must not depend on
        jump-forward, the tokens are a guess: unverified, not reported, until the extend's
        logits confirm them (`verify`). A sampled request keeps them at once: its text is
        random anyway, and every token stays allowed by the grammar."""
        p = req.params
        wants_logprobs = p.logprobs is not None or p.prompt_logprobs is not None
        if not self.jump_forward_enabled or wants_logprobs:
            return 0
        room = req.remaining_new_tokens - 1
        forced = jump_tokens(req.grammar.forced_tokens(), room, p.stop_token_ids)
        if not forced:
            return 0
        for t in forced:
            req.grammar.advance(t)
        req.output_ids.extend(forced)
        if not p.greedy:
            req.verified = len(req.output_ids)
        return len(forced)

    def verify(
        self, req: Constrained, rows: torch.Tensor, choose: Choose
    ) -> tuple[int | None, int]:
        """Check `req`'s unverified jump-forward tokens against `rows`, the extend's logits
        predicting each of them: the token greedy sampling (grammar mask, bias, penalties)
        picks at each is the next one, while they agree. Returns (None, 0) if all agree.
        Otherwise drops the tokens from the first disagreement on (output and grammar state;
        the caller drops their KV) and returns the model's token there, which the caller
        appends as if sampled, and how many tokens were dropped."""
        jumped = req.output_ids[req.verified :]
        n = len(jumped)
        grammar = req.grammar
        mask = torch.empty(n, bitmask_words(self._vocab), dtype=torch.int32)
        grammar.rollback(n)
        for k, t in enumerate(jumped):
            grammar.fill_bitmask(mask[k])
            grammar.advance(t)
        chosen = choose(req, rows, mask)
        k = next((k for k in range(n) if chosen[k] != jumped[k]), None)
        if k is None:
            return None, 0
        grammar.rollback(n - k)
        del req.output_ids[req.verified + k :]
        return chosen[k], n - k

    def unjump(self, req: Constrained) -> None:
        """Drop the unverified jump-forward tokens of `req` (which has no KV for them)."""
        req.grammar.rollback(req.unverified)
        del req.output_ids[req.verified :]


def _fill_chain(
    grammar: GrammarMatcher, tokens: tuple[int, ...], buf: torch.Tensor, eos_ids: frozenset[int]
) -> None:
    """Rows 0..len(tokens) of `buf`: the grammar's masks along a chain, in one walk."""
    advanced, alive = 0, True
    for j in range(len(tokens) + 1):
        if alive:
            grammar.fill_bitmask(buf[j])
        else:
            buf[j].copy_(buf[j - 1])
        if j == len(tokens) or not alive:
            continue
        if not _allows(buf[j], tokens[j]):
            alive = False
        elif tokens[j] not in eos_ids:
            try:
                grammar.advance(tokens[j])
                advanced += 1
            except ValueError:
                alive = False
    grammar.rollback(advanced)


def _fill_tree(grammar: GrammarMatcher, tree: Any, buf: torch.Tensor, eos_ids) -> None:
    """Row 0 of `buf`: the grammar's mask now; row 1 + n: after draft node n's branch."""
    grammar.fill_bitmask(buf[0])
    alive = {-1: True}
    for node, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        above = buf[1 + parent] if parent >= 0 else buf[0]
        alive[node] = alive[parent] and _allows(above, token)
        if not alive[node]:
            buf[1 + node].copy_(above)
            continue
        advanced = 0
        try:
            for a in tree.path(node):
                if tree.tokens[a] not in eos_ids:
                    grammar.advance(tree.tokens[a])
                    advanced += 1
            grammar.fill_bitmask(buf[1 + node])
        except ValueError:
            alive[node] = False
            buf[1 + node].copy_(above)
        grammar.rollback(advanced)


def _allows(row: torch.Tensor, token: int) -> bool:
    """Whether bitmask `row` (int32 words on the CPU) allows `token`."""
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def _no_tokenizer() -> GrammarCompiler:
    raise ValueError("json_schema/regex/choice: this model has no tokenizer")
