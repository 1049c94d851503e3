"""Apply a grammar's allowed-token bitmask to logits, in place.

Layout (shared with braid/runtime/constrained/): `bitmask` is int32 [rows, words], normally
words = ceil(vocab / 32); bit j (least significant first) of word w is token 32 * w + j, and 1
means allowed. When the mask is narrower than the logits (a tokenizer vocabulary smaller than
the model's padded one), tokens at or past 32 * words are banned; bits past vocab are ignored.
One program covers `BLOCK_W` words (32 * BLOCK_W tokens) of one row and writes -inf only where
a token is disallowed, so allowed logits are never rewritten.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from braid.kernels._checks import FLOAT_DTYPES, INDEX_DTYPES, check_tensor


@triton.jit
def _bitmask_kernel(
    Logits,
    Bitmask,
    Indices,
    stride_l,
    stride_b,
    vocab,
    num_words,
    BLOCK_W: tl.constexpr,
    HAS_INDICES: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    if HAS_INDICES:
        row = tl.load(Indices + i).to(tl.int64)
    else:
        row = i
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    # Words past the mask's width read as 0: their tokens are banned.
    words = tl.load(Bitmask + i * stride_b + offs_w, mask=offs_w < num_words, other=0)
    bit = tl.arange(0, 32)
    tokens = offs_w[:, None] * 32 + bit[None, :]
    allowed = ((words[:, None] >> bit[None, :]) & 1) != 0
    tl.store(
        Logits + row * stride_l + tokens,
        tl.full([BLOCK_W, 32], float("-inf"), dtype=Logits.dtype.element_ty),
        mask=(tokens < vocab) & ~allowed,
    )


def _check(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None
) -> torch.Tensor | None:
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    batch, vocab = logits.shape
    check_tensor("bitmask", bitmask, ndim=2, dtypes=(torch.int32,), device=logits.device)
    rows = batch
    if indices is not None:
        check_tensor("indices", indices, ndim=1, dtypes=INDEX_DTYPES, device=logits.device)
        rows = indices.shape[0]
    if bitmask.shape[0] != rows:
        what = "len(indices)" if indices is not None else "logits rows"
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows, expected {what} = {rows}")
    return indices


def apply_token_bitmask_(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> None:
    """Set `logits[r, t] = -inf` wherever token t's bit is 0, in place.

    `logits`: float [batch, vocab], unit stride in vocab; `bitmask`: int32 [n, words] (layout
    in the module docstring; words is normally ceil(vocab / 32), tokens at or past 32 * words
    are banned, bits past vocab ignored), unit stride in its last dimension. Without
    `indices`, n == batch and bitmask row i applies to logits row i; with `indices`
    (int32/int64 [n], each a distinct row in [0, batch)), bitmask row i applies to logits row
    indices[i] and other rows are untouched. No host synchronisation.
    """
    indices = _check(logits, bitmask, indices)
    rows, words = bitmask.shape
    vocab_words = -(-logits.shape[1] // 32)
    if rows == 0 or vocab_words == 0:
        return
    block_w = 32
    _bitmask_kernel[(rows, triton.cdiv(vocab_words, block_w))](
        logits,
        bitmask,
        indices if indices is not None else bitmask,
        logits.stride(0),
        bitmask.stride(0),
        logits.shape[1],
        words,
        BLOCK_W=block_w,
        HAS_INDICES=indices is not None,
        num_warps=4,
    )


def apply_token_bitmask_reference(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> None:
    """What `apply_token_bitmask_` does, in plain torch (also in place)."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:  # a narrow mask bans the tokens it does not cover
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    rows = indices.long() if indices is not None else torch.arange(logits.shape[0])
    rows = rows.to(logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
