"""AWQ checkpoints (AutoAWQ's GEMM format, `quant_method: "awq"`, `version: "gemm"`): 4-bit
weights with a zero point per group, read into braid's int4 layout (`int4.py`).

Per linear layer, in the checkpoint (K inputs, N outputs, G = group size):
- `qweight` int32 [K, N / 8]: row k holds the codes of W.T[k]; word j packs outputs 8j..8j+7
  in the interleaved order of AutoAWQ's GEMM kernel, nibble i (bits 4i..4i+3) holding output
  8j + AWQ_ORDER[i];
- `qzeros` int32 [K / G, N / 8]: the zero points, packed the same way;
- `scales` float16 [K / G, N].
The weight is W[n, k] = (code - zero) * scale, code, zero in 0..15.

With `quantization="awq"` and a float checkpoint, weights are quantized as they load (round to
nearest, group size 128, else 64 or 32 where 128 does not divide a layer's input size): AWQ's
storage and kernels without its calibration, which needs activations braid does not have.
"""

from __future__ import annotations

import torch
from torch import nn

from braid.kernels.quant_reference import PACK, pack_int4, unpack_int4
from braid.runtime.quantization import QUANTIZATION_METHODS
from braid.runtime.quantization.base import (
    LinearSpec,
    QuantizationMethod,
    check_shard_multiple,
    loadable,
    sliced_loader,
)
from braid.runtime.quantization.int4 import (
    Int4LinearMethod,
    Int4Weights,
    group_size_of,
    online_group_size,
)

# Nibble i of a word holds output column 8j + AWQ_ORDER[i] (AutoAWQ's GEMM packing).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Output column c of a word is in nibble AWQ_REVERSE_ORDER[c].
AWQ_REVERSE_ORDER = tuple(AWQ_ORDER.index(c) for c in range(PACK))

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """AWQ-packed int32 [R, C] -> uint8 codes [R, 8 C] in output order."""
    nibbles = unpack_int4(words).reshape(words.shape[0], -1, PACK)
    order = torch.tensor(AWQ_REVERSE_ORDER, device=words.device)
    return nibbles.index_select(2, order).reshape(words.shape[0], -1)


def read_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> Int4Weights:
    """AWQ's GEMM tensors of one layer in braid's int4 layout."""
    codes = unpack_awq(qweight).T.contiguous()  # [N, K]
    return Int4Weights(
        qweight=pack_int4(codes),
        scales=scales.float().contiguous(),
        zeros=unpack_awq(qzeros).contiguous(),
        group_size=group_size,
    )


class AWQCheckpoint:
    """One layer's AWQ tensors: `qweight`, `qzeros`, `scales` (each shard of a fused layer a
    slice of their output columns)."""

    def __init__(self, spec: LinearSpec, group_size: int) -> None:
        check_shard_multiple(spec, PACK, "AWQ's packing of 8 outputs per int32")
        self.spec, self.group_size = spec, group_size

    def parameters(self) -> dict[str, nn.Parameter]:
        spec, shards = self.spec, tuple(self.spec.shards)
        k, n, groups = spec.in_features, spec.out_features, spec.in_features // self.group_size
        words = sliced_loader(spec, 1, unit=PACK, dtypes=(torch.int32,))
        self.params = {
            "qweight": loadable((k, n // PACK), torch.int32, words, shards),
            "qzeros": loadable((groups, n // PACK), torch.int32, words, shards),
            "scales": loadable(
                (groups, n), torch.float32, sliced_loader(spec, 1, dtypes=FLOATS), shards
            ),
        }
        return self.params

    def read(self) -> Int4Weights:
        p = self.params
        return read_awq(p["qweight"].data, p["qzeros"].data, p["scales"].data, self.group_size)


@QUANTIZATION_METHODS.register
class AWQ(QuantizationMethod):
    """AutoAWQ's `quantization_config`: `bits` (or `w_bit`) 4, `group_size` (or
    `q_group_size`; -1: one group per row), `zero_point` true, `version` "gemm",
    `modules_to_not_convert` (modules left in floats: a list of names, each matching a module
    whose dotted name contains it)."""

    name = "awq"

    def __init__(self, config: dict | None, *, online: bool) -> None:
        super().__init__(config, online=online)
        c = self.config
        bits = c.get("bits", c.get("w_bit", 4))
        if bits != 4:
            raise ValueError(f"quantization_config bits: AWQ with {bits} bits is not supported (4)")
        version = str(c.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(
                f"quantization_config version: AWQ {version!r} checkpoints are not supported (gemm)"
            )
        if c.get("zero_point", True) is not True:
            raise ValueError(
                "quantization_config zero_point: AWQ without zero points is not supported"
            )
        self.group_size = c.get("group_size", c.get("q_group_size", 128))
        skip = c.get("modules_to_not_convert") or []
        if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
            raise ValueError(
                f"quantization_config modules_to_not_convert must be a list of names, got {skip!r}"
            )
        self.skip = skip

    def linear_method(self, spec: LinearSpec, checkpoint_names: tuple[str, ...]):
        if self.online and not self.config:
            return Int4LinearMethod(spec, online_group_size(spec), None)
        # AutoAWQ skips a module whose name contains an entry.
        hit = [any(s in name for s in self.skip) for name in checkpoint_names]
        if all(hit) and hit:
            return None
        if any(hit):
            raise ValueError(
                f"{spec.name}: modules_to_not_convert names some of this fused layer's parts "
                "but not all; braid needs all or none of them quantized"
            )
        group = group_size_of(spec, self.group_size)
        if self.online:
            return Int4LinearMethod(spec, group, None)
        return Int4LinearMethod(spec, group, AWQCheckpoint(spec, group))
