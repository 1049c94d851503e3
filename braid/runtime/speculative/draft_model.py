"""A draft model: a smaller model with the target's tokenizer guesses the next tokens.

The draft runs in the scheduler's process through its own `ModelRunner` (its own paged KV pool,
request-to-token table and CUDA graphs), holding for each request the KV of the text it has
seen. Each step it catches up on what the request gained since (the tokens the last verify step
kept: one or two, as decode rows; a new request's whole text, as an extend), then decodes its
drafts one at a time. Its samples use the request's own sampling parameters and seed at the same
positions as the target, so where the two models agree the draft's draw is the target's draw
and is kept. After a verify step the draft's KV is cut back to the drafts that were kept.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from braid.runtime.executor.model_runner import ModelRunner
from braid.runtime.executor.sampler import Sampler, SamplingInput
from braid.runtime.models.config import ModelConfig
from braid.runtime.speculative import PROPOSERS
from braid.runtime.speculative.base import Drafting, Proposer
from braid.runtime.speculative.rows import extend_batch, row_batch
from braid.runtime.speculative.tree import DraftTree

if TYPE_CHECKING:
    from braid.runtime.config import EngineConfig

logger = logging.getLogger(__name__)

# A catch-up of at most this many tokens a request runs as decode rows (a CUDA graph on GPU);
# longer ones (a new request's whole text) as an extend.
ROWS_MAX = 4


@dataclass(eq=False)
class DraftState:
    """One request's KV in the draft model, and what the last `propose` gave it."""

    pool_row: int
    pages: list[int] = field(default_factory=list)
    kv_len: int = 0
    base: int | None = None  # the request's length when drafts were last proposed, until verified


@PROPOSERS.register
class DraftModelProposer(Proposer):
    name = "DRAFT"

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.sampler = Sampler(runner.model_config.vocab_size, runner.device)
        self.states: dict[str, DraftState] = {}

    @classmethod
    def from_config(cls, config: EngineConfig, target: ModelRunner) -> DraftModelProposer:
        from braid.runtime.models.source import resolve_model

        where = "speculative_draft_model_path"
        path = Path(resolve_model(config.speculative_draft_model_path))
        draft_cfg = ModelConfig.from_dir(path)
        target_cfg = target.model_config
        if draft_cfg.vocab_size > target_cfg.vocab_size:
            raise ValueError(
                f"{where}: the draft model's vocabulary ({draft_cfg.vocab_size}) is larger than "
                f"the target's ({target_cfg.vocab_size}): it needs the target's tokenizer"
            )
        _check_same_tokenizer(path, target.model_dir, where)
        steps = config.speculative_steps
        capacity = target.kv_pool.allocator.capacity_tokens
        # Every request's draft KV is at most its target KV plus its drafts.
        tokens = capacity + target.max_running_requests * (steps + 2 * config.page_size)
        unspeculative = {
            f.name: f.default
            for f in dataclasses.fields(config)
            if f.name.startswith("speculative_")
        }  # the draft model runs plain decoding (a step count alone would be refused)
        settings = dataclasses.replace(
            config,
            **unspeculative,
            model=str(path),
            kv_tokens=tokens,
            mem_fraction_static=None,
            max_running_requests=target.max_running_requests,
            context_length=None,
            cuda_graph_max_bs=min(config.effective_cuda_graph_max_bs, target.max_running_requests),
        )
        try:
            runner = ModelRunner(
                settings, draft_cfg, None if config.load_format == "dummy" else path
            )
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
        if runner.context_length < target.context_length:
            raise ValueError(
                f"{where}: the draft model's context ({runner.context_length} tokens) is "
                f"shorter than the target's ({target.context_length})"
            )
        logger.info("speculative decoding: draft model %s, %d drafts a step", path.name, steps)
        return cls(runner)

    # ---- per-request state --------------------------------------------------------------------
    def _state(self, req: Drafting) -> DraftState:
        st = self.states.get(req.rid)
        if st is None:
            row = self.runner.req_to_token.alloc()
            assert row is not None, "the draft model has a table row for every running request"
            st = self.states[req.rid] = DraftState(row)
        return st

    def _trim(self, st: DraftState, kv_len: int) -> None:
        allocator = self.runner.kv_pool.allocator
        st.kv_len = kv_len
        keep = allocator.pages_for(kv_len)
        allocator.free(st.pages[keep:])
        del st.pages[keep:]

    def release(self, req: Drafting) -> None:
        st = self.states.pop(req.rid, None)
        if st is not None:
            self.runner.kv_pool.allocator.free(st.pages)
            self.runner.req_to_token.free(st.pool_row)

    def verified(self, req: Drafting, drafts: DraftTree, kept: int) -> None:
        st = self.states.get(req.rid)
        if st is None or st.base is None:
            return
        # Valid: what it had seen, and the drafts kept that it also decoded (the last draft
        # was sampled, never fed back).
        self._trim(st, st.base + min(kept, max(len(drafts) - 1, 0)))
        st.base = None

    # ---- drafting -----------------------------------------------------------------------------
    def propose(self, reqs: Sequence[Drafting], limits: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in reqs]
        todo = [i for i, k in enumerate(limits) if k > 0]
        if not todo:
            return drafts
        states = [self._state(reqs[i]) for i in todo]
        news = []
        for i, st in zip(todo, states):
            st.base = reqs[i].seq_len
            news.append(reqs[i].tokens()[st.kv_len :])
        first = self._catch_up(states, news, [reqs[i].sampling for i in todo])
        for i, t in zip(todo, first):
            drafts[i].append(t)
        live = [k for k, i in enumerate(todo) if limits[i] > 1]
        while live:
            holders = [states[k] for k in live]
            rows = [[drafts[todo[k]][-1]] for k in live]
            batch = row_batch(holders, rows, *self._pool())
            for st in holders:
                st.kv_len += 1
            inputs = [reqs[todo[k]].sampling.after(drafts[todo[k]]) for k in live]
            nxt = self.sampler.sample(self.runner.forward(batch), inputs).next_ids.tolist()
            for k, t in zip(live, nxt):
                drafts[todo[k]].append(t)
            live = [k for k in live if len(drafts[todo[k]]) < limits[todo[k]]]
        return drafts

    def _pool(self):
        r = self.runner
        return r.kv_pool.allocator, r.req_to_token, r.device

    def _catch_up(
        self,
        states: list[DraftState],
        news: list[list[int]],
        inputs: list[SamplingInput],
    ) -> list[int]:
        """Feed each state the tokens it has not seen and sample the first draft after them."""
        if max(len(t) for t in news) <= ROWS_MAX:
            batch = row_batch(states, news, *self._pool())
            logits = self.runner.forward(batch)
            ends, k = [], -1
            for t in news:
                k += len(t)
                ends.append(k)
            logits = logits[ends]
        else:
            batch = extend_batch(states, news, *self._pool())
            logits = self.runner.forward(batch)
        for st, t in zip(states, news):
            st.kv_len += len(t)
        return self.sampler.sample(logits, inputs).next_ids.tolist()

    def shutdown(self) -> None:
        self.states.clear()


def _check_same_tokenizer(draft: Path, target: Path | None, where: str) -> None:
    """`ValueError` when both directories have a tokenizer.json and their vocabularies differ."""
    if target is None or not target.is_dir():
        return
    a, b = draft / "tokenizer.json", target / "tokenizer.json"
    if not (a.is_file() and b.is_file()):
        return
    va = json.loads(a.read_text())["model"].get("vocab")
    vb = json.loads(b.read_text())["model"].get("vocab")
    if va != vb:
        raise ValueError(f"{where}: the draft model's tokenizer is not the target's")
