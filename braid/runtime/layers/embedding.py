"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from braid.runtime.layers.linear import select_linear_fn
from braid.runtime.layers.norm import default_weight_loader
from braid.runtime.quantization.base import LinearMethod, LinearSpec


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = default_weight_loader
        self.weight.shard_names = (None,)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits; `tied_to` reuses an embedding's weight.

    A GGUF model kept quantized on the CPU also holds the file's own blocks of the head's
    weight (`keep_gguf_blocks`, called by the loader) and computes the logits of up to
    `QUANTIZED_MAX_ROWS` rows from them (`method`); more rows, and the embedding lookups the
    head may be tied to, use the float weight. The two differ by the quantized path's
    rounding (bfloat16 activations, scales and logits: about 0.05 on logits of 18 for
    SmolLM2), so a request's logits, and a near-tie's greedy token, can depend on how many
    rows its step holds, as they do on a GPU in bfloat16. That rounding tied or swapped the
    top two tokens of real prompts (the demo's chat answer began "L'Étoile" where the float
    model says "The capital of France is Paris."), so each row's logits near its largest are
    computed again from the float weight (`refine`): greedy and the likeliest tokens sampling
    chooses between are ranked as the float head ranks them, for a few dot products a row. A
    speculative verify step chooses the path by its requests, not its rows (one per draft
    token), so speculation's logits are decoding's."""

    # torch's CPU int4 kernel (which a Q8_0 head runs as two 4-bit halves) costs about 1 ms a
    # row at SmolLM2's head (49152 x 576) on two cores, against 4-11 ms for the float32 matmul
    # of 1-16 rows: 2.3 / 3.8 / 7.8 / 16.2 ms against 4.3 / 8.8 / 8.3 / 11.3 ms for 1 / 4 / 8 /
    # 16 rows (measured 2026-12-02, Intel Xeon, 2 threads).
    QUANTIZED_MAX_ROWS = 8
    # The rounding is about 0.05 on logits of 18 (see above): every token within this of a
    # row's largest quantized logit is computed again, which holds the float head's top one.
    REFINE_MARGIN = 0.5
    # At most this many a row on average (a flat row would gather the whole weight); past it,
    # each row's largest this many.
    REFINE_MAX = 64

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        tied_to: VocabEmbedding | None = None,
    ) -> None:
        super().__init__()
        self.tied = tied_to is not None
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(
                torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False
            )
            self.weight.weight_loader = default_weight_loader
            self.weight.shard_names = (None,)
        self._linear = select_linear_fn(self.weight.device, dtype)
        self.method: LinearMethod | None = None

    def keep_gguf_blocks(self, blocks: torch.Tensor, qtype: str) -> None:
        """Compute the logits from a GGUF file's blocks of this head's weight (uint8 [vocab,
        row bytes] of `qtype`, one of the types braid keeps) through its `GGUFLinearMethod`, for
        steps of few rows: the head then reads a quarter to a half of the float32 weight's
        bytes (the largest layer of a small model's decode step)."""
        from braid.runtime.quantization.gguf import GGUFLinearMethod

        vocab, hidden = self.weight.shape
        dev = self.weight.device
        spec = LinearSpec("lm_head", hidden, {None: (0, vocab)}, self.weight.dtype, dev)
        method = GGUFLinearMethod(spec, {None: qtype})
        method.load_shard(blocks, None)
        for name, param in method.finish_loading().items():
            self.register_parameter(f"quantized_{name}", param)
        self.method = method

    def _quantized(self, h: torch.Tensor, rows: int | None) -> bool:
        rows = h.shape[0] if rows is None else rows
        return self.method is not None and rows <= self.QUANTIZED_MAX_ROWS

    def refine(self, h: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The quantized `logits` [M, vocab] of `h` [M, hidden] as float32, with each row's
        logits within `REFINE_MARGIN` of its largest recomputed from the float weight (a
        mask and a gather; a top-k over the whole vocabulary is only the fallback)."""
        logits = logits.float()
        near = logits >= logits.amax(dim=-1, keepdim=True) - self.REFINE_MARGIN
        if int(near.sum()) > self.REFINE_MAX * logits.shape[0]:
            top = logits.topk(self.REFINE_MAX, dim=-1).indices
            near = torch.zeros_like(near).scatter_(1, top, True)
        rows, cols = near.nonzero(as_tuple=True)
        weights = self.weight.index_select(0, cols).float()
        logits[rows, cols] = (weights * h.float().index_select(0, rows)).sum(-1)
        return logits

    def forward(self, h: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """The logits of `h`; `rows` (default: h's) chooses between the quantized and the float
        path, so a verify step's rows of up to `QUANTIZED_MAX_ROWS` requests are computed as
        those requests' decode step computes them (`ForwardBatch.head_rows`)."""
        if self._quantized(h, rows):
            return self.refine(h, self.method.apply(h, None))
        return self._linear(h, self.weight, None)

    def reference(self, h: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """What `forward` computes, with a quantized head's torch reference (tests)."""
        if self._quantized(h, rows):
            return self.refine(h, self.method.reference(h, None))
        return self._linear(h, self.weight, None)
