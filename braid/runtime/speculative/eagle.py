"""EAGLE drafts: the draft network (`eagle_model`) over the target's hidden states.

The draft's KV sits in its own one-layer pool but at the target's slots (the target's
request-to-token table addresses both), so a prefix the radix cache holds carries the draft's
KV as well. After each target forward the request's new features are kept (`observe`); the next
step feeds them, each with the token after its position, to the draft (catching up on what the
target kept), then drafts one token at a time from the draft's own features. The draft's entries
past the target's KV (its guesses) are written at the slots the verify step takes next, and
overwritten by the next catch-up. Drafts are sampled as the target samples (the request's seed
at the same positions), so a draft that agrees with the target is its draw.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from braid.runtime.attention import create_backend
from braid.runtime.cache.memory_pool import KVPool
from braid.runtime.executor.sampler import Sampler
from braid.runtime.forward_batch import ForwardBatch, ForwardMode, packed_to_device
from braid.runtime.speculative import PROPOSERS
from braid.runtime.speculative.base import Drafting, Proposer
from braid.runtime.speculative.checkpoint import safetensors_dir
from braid.runtime.speculative.eagle_model import WEIGHTS, EagleDraft, EagleSpec
from braid.runtime.speculative.rows import extend_batch, row_batch
from braid.runtime.speculative.tree import DraftTree

if TYPE_CHECKING:
    from braid.runtime.config import EngineConfig
    from braid.runtime.executor.model_runner import ModelRunner
    from braid.runtime.models.config import ModelConfig

logger = logging.getLogger(__name__)

# A catch-up of at most this many positions a request runs as decode rows; longer (after a
# prefill) as an extend.
ROWS_MAX = 8
WHERE = "speculative_draft_model_path"


def _version(config: EngineConfig) -> int:
    return 3 if config.speculative_algorithm == "EAGLE3" else 1


@PROPOSERS.register
class EagleProposer(Proposer):
    name = "EAGLE"

    def __init__(self, draft: EagleDraft, target: ModelRunner, pool: KVPool, backend) -> None:
        self.draft = draft
        self.target = target
        self.pool = pool
        self.backend = backend
        self.sampler = Sampler(target.model_config.vocab_size, target.device)
        config = target.config
        self.topk = config.speculative_eagle_topk or 1
        self.tree_nodes = config.speculative_tree_nodes  # 0: chains (topk 1)
        # The draft's own entries for the nodes it expands (scratch pages, per request).
        self.scratch_nodes = self.topk * config.speculative_steps if self.tree_nodes else 0
        # Each request's features not yet fed to the draft: (first position, [n, dim]).
        self.pending: dict[str, tuple[int, torch.Tensor]] = {}
        hot = getattr(draft, "d2t", None)
        self.hot_ids = (
            None if hot is None else hot.data + torch.arange(hot.shape[0], device=hot.device)
        )

    @classmethod
    def target_capture(cls, config: EngineConfig, model: ModelConfig) -> tuple[bool, tuple]:
        if _version(config) == 1:
            return True, ()
        n = model.num_layers
        # The outputs of a low, a middle and a high layer (SGLang's choice by default).
        layers = _spec(config).aux_layers or (1, n // 2 - 1, n - 4)
        if len(layers) != 3 or not all(0 <= i < n for i in layers):
            raise ValueError(
                f"{WHERE}: EAGLE-3 reads 3 layers of the target's {n}, got {list(layers)}"
            )
        return True, tuple(layers)

    @classmethod
    def from_config(cls, config: EngineConfig, target: ModelRunner) -> EagleProposer:
        from braid.runtime.models.loader import load_weights

        cfg = target.model_config
        if cfg.is_multimodal:
            raise ValueError("speculative_algorithm EAGLE: not with a vision-language model")
        path = Path(config.speculative_draft_model_path)
        spec = _spec(config)
        dcfg = spec.config
        if dcfg.vocab_size != cfg.vocab_size:
            raise ValueError(
                f"{WHERE}: the EAGLE head's vocabulary ({dcfg.vocab_size}) is not the target's "
                f"({cfg.vocab_size})"
            )
        if spec.version == 1 and dcfg.hidden_size != cfg.hidden_size:
            raise ValueError(
                f"{WHERE}: the EAGLE head's hidden size ({dcfg.hidden_size}) is not the "
                f"target's ({cfg.hidden_size})"
            )
        with torch.device(target.device):
            draft = EagleDraft(spec, cfg.hidden_size, target.dtype, target.context_length)
        try:
            with safetensors_dir(path, WEIGHTS) as tensors:
                load_weights(draft, tensors, progress=False)
        except ValueError as e:
            raise ValueError(f"{WHERE}: EAGLE head: {e}") from None
        draft.eval()
        allocator = target.kv_pool.allocator
        # The target's KV dtype: an fp8 target cache makes the draft's fp8 too (scales 1.0:
        # EAGLE heads ship none).
        pool = KVPool(
            1,
            allocator.capacity_pages + 1,
            allocator.page_size,
            dcfg.num_kv_heads,
            dcfg.head_dim,
            target.kv_pool.dtype,
            target.device,
        )
        for buf in pool.k + pool.v:  # a slot read before it is written holds zeros
            buf.zero_()
        backend = create_backend(
            config.effective_attention_backend,
            kv_pool=pool,
            req_to_token=target.req_to_token,
            num_heads=dcfg.num_heads,
            num_kv_heads=dcfg.num_kv_heads,
            head_dim=dcfg.head_dim,
        )
        logger.info("speculative decoding: EAGLE-%d head from %s", spec.version, path.name)
        return cls(draft, target, pool, backend)

    # ---- features in ---------------------------------------------------------------------------
    def observe(
        self,
        reqs: Sequence[Drafting],
        starts: Sequence[int],
        rows: Sequence[Sequence[int]],
        batch: Any,
    ) -> None:
        index = torch.tensor([i for r in rows for i in r], device=batch.hidden_states.device)
        if self.draft.version == 1:
            feats = batch.hidden_states.index_select(0, index)
        else:
            feats = torch.cat([a.index_select(0, index) for a in batch.aux_hidden_states], -1)
        at = 0
        for req, start, r in zip(reqs, starts, rows):
            new = feats[at : at + len(r)]
            at += len(r)
            held = self.pending.get(req.rid)
            if held is not None and held[0] <= start <= held[0] + held[1].shape[0]:
                new = torch.cat([held[1][: start - held[0]], new])  # continues what is held
                start = held[0]
            self.pending[req.rid] = (start, new)

    def release(self, req: Drafting) -> None:
        self.pending.pop(req.rid, None)

    # ---- drafting ------------------------------------------------------------------------------
    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        embed = getattr(self.draft, "embed_tokens", None)
        if embed is None:
            embed = self.target.model.model.embed_tokens
        return embed(ids)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target-vocabulary logits (float32) of the draft's hidden states."""
        if self.draft.version == 1:
            return self.target.model.lm_head(hidden).float()
        small = self.draft.lm_head(hidden).float()
        full = small.new_full((small.shape[0], self.sampler.vocab_size), float("-inf"))
        return full.index_copy_(1, self.hot_ids, small)

    def _run(self, batch, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.backend.init_forward_metadata(batch)
        hidden, feats = self.draft(batch, self.backend, self._embed(batch.input_ids), features)
        return self._logits(hidden[batch.logits_indices]), feats[batch.logits_indices]

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Drafting], limits: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in reqs]
        todo = [i for i, k in enumerate(limits) if k > 0 and reqs[i].rid in self.pending]
        if not todo:
            return drafts
        holders = [reqs[i] for i in todo]
        starts, feats, tokens = [], [], []
        for req in holders:
            start, f = self.pending.pop(req.rid)
            starts.append(start)
            feats.append(f)
            # Position t's feature goes with the token at t + 1 (the newest one for the last).
            tokens.append(req.tokens()[start + 1 : start + 1 + f.shape[0]])
        # The requests' own pages and table rows: every position here already has a slot.
        table, device = self.target.req_to_token, self.target.device
        allocator = self.target.kv_pool.allocator
        if max(len(t) for t in tokens) <= ROWS_MAX:
            batch = row_batch(holders, tokens, allocator, table, device, starts=starts)
            logits, g = self._run(batch, torch.cat(feats))
            last = torch.tensor([len(t) for t in tokens], device=device).cumsum(0) - 1
            logits, g = logits[last], g[last]
        else:
            batch = extend_batch(holders, tokens, allocator, table, device, starts=starts)
            logits, g = self._run(batch, torch.cat(feats))
        pos = [s + len(t) for s, t in zip(starts, tokens)]  # the next entry's position
        if self.tree_nodes:
            trees = self._grow_trees(holders, [limits[i] for i in todo], logits, g, pos)
            for i, tree in zip(todo, trees):
                drafts[i] = tree
            return drafts
        inputs = [r.sampling for r in holders]
        ids = self.sampler.sample(logits, inputs).next_ids.tolist()
        for i, t in zip(todo, ids):
            drafts[i].append(t)
        live = [k for k, i in enumerate(todo) if limits[i] > 1]
        while live:
            batch = row_batch(
                [holders[k] for k in live],
                [[drafts[todo[k]][-1]] for k in live],
                allocator,
                table,
                device,
                starts=[pos[k] for k in live],
            )
            logits, g_live = self._run(batch, g[live])
            g = g.index_copy(0, torch.tensor(live, device=device), g_live)
            inputs = [holders[k].sampling.after(drafts[todo[k]]) for k in live]
            for k, t in zip(live, self.sampler.sample(logits, inputs).next_ids.tolist()):
                drafts[todo[k]].append(t)
                pos[k] += 1
            live = [k for k in live if len(drafts[todo[k]]) < limits[todo[k]]]
        return drafts

    def _grow_trees(self, holders, limits, logits, g, pos) -> list[DraftTree]:
        """EAGLE-2's dynamic trees: from the catch-up's guesses, depth by depth, expand the
        `topk` likeliest nodes of the last depth (score: the product of the draft's
        probabilities along the branch) into their `topk` likeliest children; keep the
        `tree_nodes` likeliest nodes of all. The draft's entries for the nodes it expands go
        to scratch pages (freed here), each reading the catch-up's entries and its branch's."""
        device, k = self.target.device, self.topk
        allocator = self.target.kv_pool.allocator
        ps = allocator.page_size
        top = torch.log_softmax(logits, -1).topk(k, -1)
        vals, ids = top.values.tolist(), top.indices.tolist()
        # Per request: nodes (token, parent, score, depth), the last depth's, their entries.
        nodes = [[(t, -1, v, 1) for t, v in zip(ids[r], vals[r])] for r in range(len(holders))]
        frontier = [list(range(k)) for _ in holders]
        slot_of: list[dict[int, int]] = [{} for _ in holders]
        feat_of: dict[tuple[int, int], int] = {}  # (request, node) -> row of `feats`
        feats = g
        scratch = [allocator.alloc(allocator.pages_for(max(1, k * (n - 1)))) for n in limits]
        assert all(p is not None for p in scratch), "the drafter made room for the scratch"
        try:
            for depth in range(2, max(limits) + 1):
                rows = []  # (request, node)
                for r, front in enumerate(frontier):
                    if limits[r] >= depth and front:
                        best = sorted(front, key=lambda n, r=r: -nodes[r][n][2])[:k]
                        rows += [(r, n) for n in best]
                if not rows:
                    break
                for r, n in rows:
                    used = len(slot_of[r])
                    slot_of[r][n] = scratch[r][used // ps] * ps + used % ps
                batch = self._expansion_batch(holders, nodes, slot_of, rows, pos, depth, device)
                parent_feats = torch.stack(
                    [
                        g[r] if nodes[r][n][1] < 0 else feats[feat_of[(r, nodes[r][n][1])]]
                        for r, n in rows
                    ]
                )
                logits, out = self._run(batch, parent_feats)
                base = feats.shape[0]
                feats = torch.cat([feats, out])
                top = torch.log_softmax(logits, -1).topk(k, -1)
                frontier = [[] for _ in holders]
                for j, ((r, n), tv, ti) in enumerate(
                    zip(rows, top.values.tolist(), top.indices.tolist())
                ):
                    feat_of[(r, n)] = base + j
                    score = nodes[r][n][2]
                    for t, v in zip(ti, tv):
                        frontier[r].append(len(nodes[r]))
                        nodes[r].append((t, n, score + v, depth))
        finally:
            for pages in scratch:
                allocator.free(pages)
        return [_best_tree(ns, self.tree_nodes) for ns in nodes]

    def _expansion_batch(self, holders, nodes, slot_of, rows, pos, depth, device):
        """The draft's decode rows for expanding `rows` (request, node) at `depth`: node n's
        entry sits at its branch's next position, in its scratch slot, and reads the
        catch-up's entries (its table row up to `pos`) then its branch's entries."""
        ids, positions, pool_rows, locs, prefix, tails = [], [], [], [], [], []
        for r, n in rows:
            branch = []
            a = n
            while a >= 0:
                branch.append(slot_of[r][a])
                a = nodes[r][a][1]
            branch.reverse()
            ids.append(nodes[r][n][0])
            positions.append(pos[r] + depth - 2)
            pool_rows.append(holders[r].pool_row)
            locs.append(slot_of[r][n])
            prefix.append(pos[r])
            tails.append(branch + [0] * (depth - 1 - len(branch)))
        m = len(rows)
        ids_t, pos_t, rows_t, locs_t, prefix_t, tail_t = packed_to_device(
            [ids, positions, pool_rows, locs, prefix, [s for t in tails for s in t]], device
        )
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=ids_t,
            positions=pos_t,
            out_cache_loc=locs_t,
            req_pool_indices=rows_t,
            seq_lens=pos_t + 1,
            prefix_lens=positions,
            extend_lens=[1] * m,
            logits_indices=torch.arange(m, device=device),
            tree_prefix=prefix_t,
            tree_tail=tail_t.view(m, depth - 1),
        )


def _best_tree(nodes: list[tuple[int, int, float, int]], size: int) -> DraftTree:
    """The `size` likeliest nodes of (token, parent, score, depth) as a tree (a node's score
    is at most its parent's, so the likeliest nodes include their parents; ties are broken
    toward shallower nodes)."""
    order = sorted(range(len(nodes)), key=lambda n: (-nodes[n][2], nodes[n][3]))
    chosen: set[int] = set()
    for n in order:
        if len(chosen) == size:
            break
        if nodes[n][1] < 0 or nodes[n][1] in chosen:
            chosen.add(n)
    keep = sorted(chosen, key=lambda n: (nodes[n][3], -nodes[n][2]))  # parents first
    index = {n: j for j, n in enumerate(keep)}
    return DraftTree(
        tuple(nodes[n][0] for n in keep),
        tuple(-1 if nodes[n][1] < 0 else index[nodes[n][1]] for n in keep),
    )


def _spec(config: EngineConfig) -> EagleSpec:
    try:
        return EagleSpec.read(Path(config.speculative_draft_model_path), _version(config))
    except ValueError as e:
        raise ValueError(f"{WHERE}: {e}") from None
