"""What one model forward needs: the tokens, their positions, and where their KV goes.

A `ForwardBatch` is built by the scheduler for one step and passed down through the model to
the attention backend; per-forward attention state lives in its `attn_metadata`, never in a
module global.
"""

from __future__ import annotations

import array
import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from braid.runtime.image_data import ImageData


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill, possibly on top of a cached prefix
    DECODE = "decode"  # one new token per request


@dataclass(frozen=True)
class ImageSlice:
    """Rows [row, row + length) of an extend's tokens are embeddings [start, start + length)
    of `image`'s vision-tower output (an extend may cover only part of an image: a chunk, or a
    prefix-cache hit that ends inside it)."""

    image: ImageData
    row: int
    start: int
    length: int


@dataclass
class ForwardBatch:
    """Tensors for one forward. Lengths are per request, in batch order.

    `input_ids`, `positions` and `out_cache_loc` have one entry per new token (the requests'
    new tokens laid end to end). `seq_lens` is each request's length *after* this forward;
    `prefix_lens` how many of its tokens already had KV before it. `logits_indices` selects the
    rows of the hidden states whose logits are wanted.
    """

    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: list[int]
    extend_lens: list[int]
    logits_indices: torch.Tensor
    attn_metadata: Any = field(default=None)
    # An extend with image tokens: which rows take which image embeddings, and, for an M-RoPE
    # model with images in the batch, the [3, num_tokens] positions (`positions` then is unused
    # by the model). A decode's `positions` already include each request's M-RoPE delta.
    images: list[ImageSlice] = field(default_factory=list)
    mrope_positions: torch.Tensor | None = None
    # Speculative decoding and embeddings read the hidden states. With `capture_hidden` the model
    # leaves the final (normed) hidden state of every token in `hidden_states`, and the
    # output (residual stream) of each layer in `aux_layers` (EAGLE-3) in `aux_hidden_states`.
    capture_hidden: bool = False
    aux_layers: tuple[int, ...] = ()
    # A decode batch verifying draft trees: row b's first `tree_prefix[b]` keys are its table
    # row's, the rest (`seq_lens[b]` in all) the slots in `tree_tail[b]` (a draft node's
    # ancestors and itself). None: every row reads its table row alone.
    tree_prefix: torch.Tensor | None = None
    tree_tail: torch.Tensor | None = None
    # A mixed extend (`enable_mixed_chunk`): its last `decode_tail` requests are running
    # requests computing one token after their cached KV, as a decode would; a backend may run
    # them through its decode kernel (the others' rows come first, as in any extend).
    decode_tail: int = 0
    hidden_states: torch.Tensor | None = None
    aux_hidden_states: list[torch.Tensor] | None = None
    # The rows an LM head picks its path by (`LMHead.forward`), when not its input's: a verify
    # step's requests, so that each row's logits are computed as a decode step of the same
    # requests computes them (speculation's output is then decoding's).
    head_rows: int | None = None
    # What a tensor-parallel plan sends (`distributed/plan.py`) without reading the device:
    # the host values the builder made the tensors from (`host`, by field name), and for a
    # decode fed by the previous decode's samples still on the device, which of their rows it
    # takes (`sample_rows`; `input_ids` is then those samples).
    host: dict[str, list[int]] | None = None
    sample_rows: list[int] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def to_device(
    values: list[int] | list[float] | list[bool],
    device: torch.device,
    dtype: torch.dtype = torch.int64,
) -> torch.Tensor:
    """A 1-D tensor of `values` on `device`. To CUDA it goes through pinned memory without
    waiting: a plain `torch.tensor(..., device="cuda")` synchronises the stream, which would
    hold the host until the forwards already queued have run (see the overlapped decode in
    `Scheduler.step`)."""
    if dtype in _ARRAY_CODES and values:
        # Through a C array: about half torch.tensor's time on a list of ints (0.23 against
        # 0.43 ms for an 8k-token prompt's ids on the 2-core CPU).
        host = torch.frombuffer(array.array(_ARRAY_CODES[dtype], values), dtype=dtype)
    else:
        host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def packed_to_device(vectors: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Int64 `vectors` on `device` through one host-to-device copy (a copy costs a launch and,
    from pinned memory, an allocation), as views of one buffer each starting 16 bytes apart:
    Triton specialises kernels on their pointers' alignment, so views at odd offsets would
    compile second variants of them for odd lengths."""
    flat: list[int] = []
    spans = []
    for v in vectors:
        spans.append((len(flat), len(v)))
        flat += v
        if len(v) & 1:
            flat.append(0)
    packed = to_device(flat, device)
    return [packed[at : at + n] for at, n in spans]


# The array module's type codes of the integer dtypes `to_device` converts through it.
_ARRAY_CODES = {torch.int64: "q", torch.int32: "i"}
