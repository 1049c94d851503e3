"""Token bitmasks: one int32 row per constrained request, `[rows, ceil(vocab / 32)]`, bit j of
word w set when token 32 * w + j is allowed; applied to those requests' logit rows only.

Rows are written on the CPU by the grammar backends (`GrammarMatcher.fill_many`, in the
libraries' own threads where they have them) and copied to the device in one transfer. On CUDA
the mask is applied by braid's Triton kernel (`braid.kernels.apply_token_bitmask_`; if it cannot
be imported, by `apply_token_bitmask_torch`), on the CPU by a numpy version. (outlines-core's
own torch kernel goes through torch.compile, which makes its first use slow (measured:
docs/benchmarks.md, Figures behind design choices).)
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Sequence

import numpy as np
import torch

from braid.runtime.constrained.grammar import GrammarMatcher

logger = logging.getLogger(__name__)

ApplyFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_token_bitmask_torch(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor
) -> None:
    """Set `logits[indices[i], t]` to -inf for every token t whose bit is clear in
    `bitmask[i]`, in place. `logits`: [B, V] float; `bitmask`: [R, W] int32 on the same device;
    `indices`: [R] int64 row numbers, distinct. Tokens at or past 32 * W are banned; bits past V
    are ignored. Other rows are untouched."""
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be 2-D int32, got {bitmask.dim()}-D {bitmask.dtype}")
    if indices.shape != (bitmask.shape[0],):
        raise ValueError(f"indices must have shape ({bitmask.shape[0]},), got {indices.shape}")
    rows, vocab = bitmask.shape[0], logits.shape[1]
    if rows == 0:
        return
    # Each mask byte looks up its 8 additive terms (0 allowed, -inf banned): one gather and one
    # add, several times faster on CPU than unpacking bits and masked_fill.
    lut = _byte_table(logits.dtype, logits.device)
    octets = bitmask.contiguous().view(torch.uint8).reshape(-1).long()
    bias = lut.index_select(0, octets).view(rows, -1)
    if bias.shape[1] >= vocab:
        bias = bias[:, :vocab]
    else:
        beyond = bias.new_full((rows, vocab - bias.shape[1]), float("-inf"))
        bias = torch.cat([bias, beyond], dim=1)
    logits.index_add_(0, indices, bias)


@functools.cache
def _byte_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8]: entry (b, j) is 0 if bit j of byte b is set, else -inf. Bytes are read from the
    int32 words in memory order, which on little-endian machines (all that torch supports)
    puts token 32 * w + 8 * k + j at bit j of byte k of word w."""
    assert sys.byteorder == "little"
    bits = (torch.arange(256)[:, None] >> torch.arange(8)[None, :]) & 1
    table = torch.zeros(256, 8).masked_fill_(bits == 0, float("-inf"))
    return table.to(dtype=dtype, device=device)


def _cuda_kernel() -> ApplyFn | None:
    try:
        from braid.kernels import apply_token_bitmask_
    except ImportError as e:
        logger.warning("token bitmask kernel unavailable (%s); using the torch version", e)
        return None
    return apply_token_bitmask_


def apply_token_bitmask_numpy(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor
) -> None:
    """`apply_token_bitmask_torch` for float32 CPU tensors, in numpy: single-threaded, so it
    pays no OpenMP start-up per operation, which on a busy 2-core machine made the torch
    version several times slower (measured: docs/benchmarks.md, Figures behind design
    choices)."""
    rows, vocab = bitmask.shape[0], logits.shape[1]
    bias = np.take(_byte_table_np(), bitmask.numpy().view(np.uint8), axis=0).reshape(rows, -1)
    width = min(bias.shape[1], vocab)
    out = logits.numpy()
    for i, row in enumerate(indices.tolist()):
        np.add(out[row, :width], bias[i, :width], out=out[row, :width])
        out[row, width:] = -np.inf


@functools.cache
def _byte_table_np() -> np.ndarray:
    return _byte_table(torch.float32, torch.device("cpu")).numpy()


_KERNELS: dict[str, ApplyFn] = {}


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor) -> None:
    """`apply_token_bitmask_torch`'s contract: on CUDA by the Triton kernel, on the CPU (float32
    logits) by `apply_token_bitmask_numpy`, elsewhere by the torch version."""
    if logits.device.type == "cpu":
        cpu_ok = logits.dtype == torch.float32 and logits.is_contiguous()
        if cpu_ok and bitmask.dtype == torch.int32 and bitmask.is_contiguous():
            apply_token_bitmask_numpy(logits, bitmask, indices)
        else:
            apply_token_bitmask_torch(logits, bitmask, indices)
        return
    fn = _KERNELS.get(logits.device.type)
    if fn is None:
        fn = (_cuda_kernel() if logits.is_cuda else None) or apply_token_bitmask_torch
        _KERNELS[logits.device.type] = fn
    fn(logits, bitmask, indices)


class BitmaskBuffer:
    """A reusable CPU buffer (pinned on CUDA, so the copy can overlap) that the constrained
    rows of a step are written into, `words` int32 words a row: the tokenizer's vocabulary's,
    which every matcher writes exactly (tokens past it, a model's padding rows, are banned
    when the mask is applied)."""

    def __init__(self, words: int, device: torch.device) -> None:
        self.words = words
        self.device = device
        self._buf = torch.empty(0, self.words, dtype=torch.int32)

    def fill(
        self,
        matchers: Sequence[GrammarMatcher],
        rows: Sequence[int],
        extra: Sequence[tuple[int, int]] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(bitmask [len(rows), words], row indices [len(rows)]), both on the device:
        `matchers[i]`'s allowed tokens, for logits row `rows[i]`, each (i, token) of `extra`
        allowing one more token in mask row i. Matchers of one backend are filled together
        (`GrammarMatcher.fill_many`). Valid until the next `fill` (on the CPU the bitmask is a
        view of the buffer)."""
        n = len(matchers)
        self.rows(n)
        self.write(matchers, range(n))
        self.allow(extra)
        return self.send(n, rows)

    def write(self, matchers: Sequence[GrammarMatcher], positions: Sequence[int]) -> None:
        """Buffer row `positions[i]` := `matchers[i]`'s mask; those of one backend together
        (`GrammarMatcher.fill_many`). The buffer must already hold the rows (`rows`)."""
        buf = self._buf
        assert not positions or buf.shape[0] > max(positions), "rows() first"
        by_class: dict[type[GrammarMatcher], list[int]] = {}
        for i, m in enumerate(matchers):
            by_class.setdefault(type(m), []).append(i)
        for cls, idx in by_class.items():
            cls.fill_many([matchers[i] for i in idx], buf, [positions[i] for i in idx])

    def allow(self, extra: Sequence[tuple[int, int]]) -> None:
        """For each (i, token): buffer row i also allows `token`."""
        octets = self._buf.view(torch.uint8)  # token t: bit t % 8 of byte t // 8 of a row
        for i, token in extra:
            octets[i, token >> 3] |= 1 << (token & 7)

    def rows(self, n: int) -> torch.Tensor:
        """The CPU buffer, at least `n` rows, for a caller writing rows itself (then `send`).
        Growing it drops what was written."""
        if self._buf.shape[0] < n:
            self._buf = torch.empty(
                max(n, 2 * self._buf.shape[0]),
                self.words,
                dtype=torch.int32,
                pin_memory=self.device.type == "cuda",
            )
        return self._buf

    def send(self, n: int, rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `n` rows written, for logits rows `rows`, on the device (as `fill`)."""
        mask = self._buf[:n]
        idx = torch.tensor(list(rows), dtype=torch.int64)
        if self.device.type == "cpu":
            return mask, idx
        # The step reads its sampled ids back (a sync) before the next fill rewrites the buffer.
        return mask.to(self.device, non_blocking=True), idx.to(self.device, non_blocking=True)
