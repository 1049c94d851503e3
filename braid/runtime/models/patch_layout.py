"""Where the patches of one Qwen2-VL-family tower pass sit, and the groups they attend in.

Several images go through the tower in one pass, their patches laid end to end in the order
the image processor emits them (per frame: merge-block row, merge-block column, then the
merge_size x merge_size patches inside the block). Attention never crosses from one frame into
another, and Qwen2.5-VL's windowed blocks attend only within windows of whole merge blocks.

Windows are not contiguous in the processor's order, so a windowed pass runs its blocks in
window order instead (as transformers does): the patches are permuted once after the patch
embedding (`PatchLayout.order`) and the merged tokens put back once after the merger
(`PatchLayout.restore`). In that order every window and every frame is a run of consecutive
patches, and when all the runs of a partition have one length (images of one size, windows
that tile them), attention is a reshape of q, k and v, with no gather or scatter per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from braid.runtime.models.vision_towers import tower_sdpa


@dataclass(frozen=True)
class Segments:
    """A partition of the pass's patches into groups that attend only among themselves (one
    frame, or one window of one), laid out as `num_segments` rows of `longest` slots.

    `runs`: every segment is a run of consecutive patches and all have one length, so the rows
    are a reshape of the patches and the other fields are None. Otherwise `index[b, s]` is the
    patch in slot `s` of segment `b` (0 in padding), `flat = index[valid]` (the patches in
    row-major slot order), `slots` the flat positions of the slots in use, and `mask` the key
    mask for attention (None when no segment is padded).
    """

    num_segments: int
    longest: int
    runs: bool
    index: torch.Tensor | None = None  # [segments, longest] int64
    valid: torch.Tensor | None = None  # [segments, longest] bool
    flat: torch.Tensor | None = None  # [patches] int64
    mask: torch.Tensor | None = None  # [segments, 1, 1, longest] bool
    # Found once per pass, so no block indexes with the boolean `valid` (which waits for the
    # device).
    slots: torch.Tensor | None = None  # [patches] int64

    @classmethod
    def from_ids(cls, ids: torch.Tensor) -> Segments:
        """`ids[p]`: the segment of patch `p`, dense in 0 .. num_segments - 1. Within a
        segment, patches keep their order."""
        n = ids.shape[0]
        counts = torch.bincount(ids)
        sorted_ids = bool((ids[1:] >= ids[:-1]).all()) if n > 1 else True
        lo, hi = (int(c) for c in torch.aminmax(counts))
        if sorted_ids and lo == hi:
            return cls(num_segments=counts.shape[0], longest=hi, runs=True)
        order = torch.argsort(ids, stable=True)
        sorted_ = ids[order]
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(n, device=ids.device) - starts[sorted_]
        shape = (counts.shape[0], hi)
        index = torch.zeros(shape, dtype=torch.int64, device=ids.device)
        valid = torch.zeros(shape, dtype=torch.bool, device=ids.device)
        index[sorted_, slot] = order
        valid[sorted_, slot] = True
        return cls(
            num_segments=counts.shape[0],
            longest=hi,
            runs=False,
            index=index,
            valid=valid,
            flat=order,
            mask=valid[:, None, None, :] if lo != hi else None,
            slots=valid.flatten().nonzero(as_tuple=True)[0],
        )

    def sizes(self) -> list[int]:
        """Each segment's number of patches."""
        if self.runs:
            return [self.longest] * self.num_segments
        return self.valid.sum(1).tolist()

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Bidirectional attention within each segment. `q`, `k`, `v`: [patches, heads, dim];
        returns [patches, heads * dim]. Padding keys are masked out; padding queries see the
        segment's keys (so stay finite) and are dropped."""
        if self.runs:
            rows = (self.num_segments, self.longest, *q.shape[1:])
            qb, kb, vb = (x.reshape(rows).transpose(1, 2) for x in (q, k, v))
            o = tower_sdpa(qb, kb, vb).transpose(1, 2)
            return o.reshape(q.shape[0], -1)
        qb, kb, vb = (x[self.index].transpose(1, 2) for x in (q, k, v))
        o = tower_sdpa(qb, kb, vb, attn_mask=self.mask).transpose(1, 2)
        out = torch.empty_like(q)
        out[self.flat] = o.reshape(-1, *o.shape[2:])[self.slots]
        return out.reshape(q.shape[0], -1)


def _axis(n: int, dim: int, device: torch.device) -> torch.Tensor:
    """`arange(n)` shaped to broadcast along `dim` of a (frame, block row, block column, row in
    block, column in block) grid."""
    shape = [1] * 5
    shape[dim] = n
    return torch.arange(n, device=device).view(shape)


@dataclass(frozen=True)
class PatchLayout:
    """One pass's patches in the order its blocks run them: their (row, column) in their
    image, the frame each belongs to and (windowed towers) the window, and `order`, the
    processor-order patch at each place (None: the processor's order itself)."""

    hw: torch.Tensor  # [patches, 2] int64
    frames: Segments
    windows: Segments | None
    order: torch.Tensor | None  # [patches] int64
    merge_unit: int  # patches per merged token

    @classmethod
    def build(
        cls,
        grids: Sequence[tuple[int, int, int]],
        merge_size: int,
        window_units: int | None,
        device: torch.device,
    ) -> PatchLayout:
        """The layout of images with (t, h, w) patch `grids`; `window_units`: a window's side
        in merge blocks (None: no windows)."""
        m, u = merge_size, window_units
        hw, frames, windows = [], [], []
        frame_base = window_base = 0
        for t, h, w in grids:
            bh, bw = h // m, w // m
            shape = (t, bh, bw, m, m)
            f, br, bc = _axis(t, 0, device), _axis(bh, 1, device), _axis(bw, 2, device)
            ir, ic = _axis(m, 3, device), _axis(m, 4, device)
            rows, cols = (br * m + ir).expand(shape), (bc * m + ic).expand(shape)
            hw.append(torch.stack((rows.flatten(), cols.flatten()), dim=-1))
            frames.append((frame_base + f).expand(shape).flatten())
            frame_base += t
            if u is not None:
                # Windows tile the merged grid from the top left; edge windows may be smaller.
                nwh, nww = -(-bh // u), -(-bw // u)
                win = window_base + (f * nwh + br // u) * nww + bc // u
                windows.append(win.expand(shape).flatten())
                window_base += t * nwh * nww
        hw_all, frame_ids = torch.cat(hw), torch.cat(frames)
        if u is None:
            return cls(hw_all, Segments.from_ids(frame_ids), None, None, m * m)
        # Window order: windows are numbered frame by frame, so frames stay runs too; a stable
        # sort keeps each window's merge blocks (and each block's patches) in order.
        window_ids = torch.cat(windows)
        order = torch.argsort(window_ids, stable=True)
        return cls(
            hw=hw_all[order],
            frames=Segments.from_ids(frame_ids[order]),
            windows=Segments.from_ids(window_ids[order]),
            order=order,
            merge_unit=m * m,
        )

    def permute(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of `x` (one per patch, processor order) in the order the blocks run them."""
        return x if self.order is None else x[self.order]

    def restore(self, merged: torch.Tensor) -> torch.Tensor:
        """The merger's rows (one per merge block, in the blocks' order) back in the
        processor's order."""
        if self.order is None:
            return merged
        block = self.order[:: self.merge_unit] // self.merge_unit
        out = torch.empty_like(merged)
        out[block] = merged
        return out
