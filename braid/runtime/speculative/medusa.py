"""Medusa heads: extra heads on the target's last hidden state, head i guessing the token i + 1
places after the one the LM head predicts (Cai et al., 2024).

Each head is `num_layers` residual blocks (`x + silu(W x + b)`) and its own vocabulary
projection, over the final (normed) hidden state of the target's row that predicted the
request's newest token. Drafts are the heads' top choices in a row. A checkpoint is a directory
with `config.json` (`medusa_num_heads`, `medusa_num_layers`) and `medusa_lm_head.safetensors`
(or the original `medusa_lm_head.pt`, read as tensors only), keys `{i}.{j}.linear.weight` /
`.bias` for block j of head i and `{i}.{num_layers}.weight` for its projection.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from braid.runtime.layers.linear import Linear
from braid.runtime.speculative import PROPOSERS
from braid.runtime.speculative.base import Drafting, Proposer
from braid.runtime.speculative.checkpoint import safetensors_dir
from braid.runtime.speculative.tree import best_first

if TYPE_CHECKING:
    from braid.runtime.config import EngineConfig
    from braid.runtime.executor.model_runner import ModelRunner
    from braid.runtime.models.config import ModelConfig

logger = logging.getLogger(__name__)

WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


class ResBlock(nn.Module):
    def __init__(self, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = Linear(hidden, {None: hidden}, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """`num_heads` heads of `num_layers` residual blocks and a projection each; parameters are
    named as the checkpoint names them, under `heads.`."""

    stacked_params: dict[str, tuple[str, str]] = {}
    ignored_key_suffixes: tuple[str, ...] = ()

    def __init__(
        self, hidden: int, vocab: int, num_heads: int, num_layers: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.heads = nn.ModuleList(
            nn.ModuleList(
                [
                    *(ResBlock(hidden, dtype) for _ in range(num_layers)),
                    Linear(hidden, {None: vocab}, bias=False, dtype=dtype),
                ]
            )
            for _ in range(num_heads)
        )

    @staticmethod
    def checkpoint_key(key: str) -> str:
        return "heads." + key

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[heads, rows, vocab] float32 logits of each head for hidden states `h`."""
        out = []
        for head in self.heads:
            x = h
            for block in head[:-1]:
                x = block(x)
            out.append(head[-1](x).float())
        return torch.stack(out)


def load_medusa(path: Path, hidden: int, vocab: int, dtype, device) -> MedusaHeads:
    """The heads in checkpoint directory `path`, loaded strictly; `ValueError` naming the
    setting when the directory or its shapes do not fit the target."""
    from braid.runtime.models.loader import load_weights

    where = "speculative_draft_model_path"
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{where}: {path} has no config.json (a Medusa checkpoint needs one)")
    cfg = json.loads(cfg_file.read_text())
    try:
        num_heads, num_layers = int(cfg["medusa_num_heads"]), int(cfg.get("medusa_num_layers", 1))
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{where}: config.json has no medusa_num_heads") from None
    with torch.device(device):
        heads = MedusaHeads(hidden, vocab, num_heads, num_layers, dtype)
    try:
        with safetensors_dir(path, WEIGHTS) as tensors:
            load_weights(heads, tensors, progress=False)
    except ValueError as e:
        raise ValueError(f"{where}: Medusa heads: {e}") from None
    return heads.eval()


@PROPOSERS.register
class MedusaProposer(Proposer):
    name = "MEDUSA"

    def __init__(self, heads: MedusaHeads, topk: int = 1, tree_nodes: int = 0) -> None:
        self.heads = heads
        self.topk = topk
        self.tree_nodes = tree_nodes  # with topk > 1: a tree of the heads' top choices
        self.hidden: dict[str, torch.Tensor] = {}  # each request's newest predicting state

    @classmethod
    def target_capture(cls, config: EngineConfig, model: ModelConfig) -> tuple[bool, tuple]:
        return True, ()

    @classmethod
    def from_config(cls, config: EngineConfig, target: ModelRunner) -> MedusaProposer:
        cfg = target.model_config
        if cfg.is_multimodal:
            raise ValueError("speculative_algorithm MEDUSA: not with a vision-language model")
        path = Path(config.speculative_draft_model_path)
        heads = load_medusa(path, cfg.hidden_size, cfg.vocab_size, target.dtype, target.device)
        logger.info("speculative decoding: %d Medusa heads from %s", len(heads.heads), path.name)
        return cls(heads, config.speculative_eagle_topk or 1, config.speculative_tree_nodes)

    def observe(
        self,
        reqs: Sequence[Drafting],
        starts: Sequence[int],
        rows: Sequence[Sequence[int]],
        batch: Any,
    ) -> None:
        # Only a row predicting the request's newest token matters (not a prompt's chunk).
        keep = [
            i for i, (r, s, k) in enumerate(zip(reqs, starts, rows)) if s + len(k) == r.seq_len - 1
        ]
        if not keep:
            return
        reqs = [reqs[i] for i in keep]
        last = torch.tensor([rows[i][-1] for i in keep], device=batch.hidden_states.device)
        states = batch.hidden_states.index_select(0, last)  # a copy: the graph's output moves on
        for req, state in zip(reqs, states):
            self.hidden[req.rid] = state

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Drafting], limits: Sequence[int]) -> list:
        drafts: list = [[] for _ in reqs]
        todo = [i for i, k in enumerate(limits) if k > 0 and reqs[i].rid in self.hidden]
        if not todo:
            return drafts
        h = torch.stack([self.hidden[reqs[i].rid] for i in todo])
        logits = self.heads(h)  # [heads, rows, vocab]
        if not self.tree_nodes:
            best = logits.argmax(dim=-1).t().tolist()  # [rows, heads]
            for i, row in zip(todo, best):
                drafts[i] = row[: limits[i]]
            return drafts
        # A tree of the heads' top choices, likeliest branches first (head d's guesses do not
        # depend on the tokens before them).
        top = logits.softmax(dim=-1).topk(self.topk, dim=-1)  # [heads, rows, k]
        probs = top.values.permute(1, 0, 2).tolist()
        ids = top.indices.permute(1, 0, 2).tolist()
        for k, i in enumerate(todo):
            depth = min(limits[i], len(ids[k]))
            guesses = [list(zip(ids[k][d], probs[k][d])) for d in range(depth)]
            drafts[i] = best_first(guesses, self.tree_nodes)
        return drafts

    def release(self, req: Drafting) -> None:
        self.hidden.pop(req.rid, None)
