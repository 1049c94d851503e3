"""GPTQ checkpoints (AutoGPTQ / GPTQModel, `quant_method: "gptq"`): 4-bit weights with a zero
point per group, with or without act-order (`desc_act`), read into braid's int4 layout.

Per linear layer, in the checkpoint (K inputs, N outputs, G = group size):
- `qweight` int32 [K / 8, N]: word j of column n packs the codes of inputs 8j..8j+7, input
  8j + i in nibble i;
- `qzeros` int32 [K / G, N / 8]: the zero points, output 8j + i in nibble i of word j, stored
  minus one (`checkpoint_format: "gptq"`, AutoGPTQ's convention: the readers add one back, so a
  stored 15 is a zero of 16) or as they are (`"gptq_v2"`);
- `scales` float16 [K / G, N];
- `g_idx` int32 [K]: the group of each input. Without act-order it is k // G (and may be
  absent); with it, GPTQ quantized the inputs in another order and g_idx says which group each
  one fell in. braid sorts the inputs by group once at load and permutes x before the kernel.
The weight is W[n, k] = (code - zero) * scale, with the group g_idx[k].
"""

from __future__ import annotations

import torch
from torch import nn

from braid.kernels.quant_reference import PACK, pack_int4, unpack_int4
from braid.runtime.quantization import QUANTIZATION_METHODS
from braid.runtime.quantization.awq import FLOATS
from braid.runtime.quantization.base import (
    LinearSpec,
    QuantizationMethod,
    check_dtype,
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

ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}
INT_DTYPES = (torch.int32, torch.int64)


def read_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    *,
    zero_offset: int = 1,
    layer: str = "layer",
) -> Int4Weights:
    """GPTQ's tensors of one layer in braid's int4 layout. `g_idx` None means k // group_size.
    `ValueError` (naming `layer`) for a g_idx whose groups are not each `group_size` inputs."""
    k = qweight.shape[0] * PACK
    zeros = unpack_int4(qzeros) + zero_offset
    w = Int4Weights(
        # GPTQ packs along K already: the transpose is braid's layout.
        qweight=qweight.T.contiguous(),
        scales=scales.float().contiguous(),
        zeros=zeros.to(torch.uint8).contiguous(),
        group_size=group_size,
    )
    if g_idx is None:
        return w
    g_idx = g_idx.to(torch.int64)
    plain = torch.arange(k, device=g_idx.device) // group_size
    if torch.equal(g_idx, plain):
        return w
    groups = k // group_size
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise ValueError(f"{layer}: g_idx holds groups outside 0..{groups - 1}")
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], plain):
        raise ValueError(
            f"{layer}: g_idx does not put exactly group_size ({group_size}) inputs in each group"
        )
    codes = unpack_int4(w.qweight).index_select(1, perm)
    w.qweight, w.perm = pack_int4(codes), perm
    return w


class GPTQCheckpoint:
    """One layer's GPTQ tensors: `qweight`, `qzeros`, `scales` (shards: slices of their output
    columns) and `g_idx` (one row per shard: braid permutes a layer's input once, so the shards
    of a fused layer must agree; needed with act-order, optional without)."""

    def __init__(
        self, spec: LinearSpec, group_size: int, *, desc_act: bool, zero_offset: int
    ) -> None:
        check_shard_multiple(spec, PACK, "GPTQ's packing of 8 zero points per int32")
        self.spec, self.group_size = spec, group_size
        self.desc_act, self.zero_offset = desc_act, zero_offset
        self.g_idx_filled: set[str | None] = set()

    def parameters(self) -> dict[str, nn.Parameter]:
        spec, shards = self.spec, tuple(self.spec.shards)
        k, n, groups = spec.in_features, spec.out_features, spec.in_features // self.group_size
        columns = sliced_loader(spec, 1, dtypes=(torch.int32,))
        self.params = {
            "qweight": loadable((k // PACK, n), torch.int32, columns, shards),
            "qzeros": loadable(
                (groups, n // PACK),
                torch.int32,
                sliced_loader(spec, 1, unit=PACK, dtypes=(torch.int32,)),
                shards,
            ),
            "scales": loadable(
                (groups, n), torch.float32, sliced_loader(spec, 1, dtypes=FLOATS), shards
            ),
            "g_idx": loadable(
                (len(shards), k),
                torch.int64,
                self._load_g_idx,
                shards if self.desc_act else (),
            ),
        }
        return self.params

    def _load_g_idx(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None) -> None:
        self.spec.shard_range(shard)
        if tuple(loaded.shape) != (self.spec.in_features,):
            raise ValueError(
                f"shard {shard!r}: g_idx shape {tuple(loaded.shape)} != expected "
                f"({self.spec.in_features},)"
            )
        check_dtype(loaded, INT_DTYPES, f"shard {shard!r} g_idx")
        param.data[list(self.spec.shards).index(shard)].copy_(loaded)
        self.g_idx_filled.add(shard)

    def read(self) -> Int4Weights:
        p, spec = self.params, self.spec
        g_idx = None
        if self.g_idx_filled:
            if len(self.g_idx_filled) != len(spec.shards):
                missing = [s for s in spec.shards if s not in self.g_idx_filled]
                raise ValueError(f"{spec.name}: g_idx missing for shards {missing}")
            rows = p["g_idx"].data
            if not all(torch.equal(rows[0], r) for r in rows[1:]):
                raise ValueError(
                    f"{spec.name}: the fused shards {list(spec.shards)} have different g_idx; "
                    "braid permutes a layer's input once, so they must agree"
                )
            g_idx = rows[0]
        return read_gptq(
            p["qweight"].data,
            p["qzeros"].data,
            p["scales"].data,
            self.group_size,
            g_idx,
            zero_offset=self.zero_offset,
            layer=spec.name,
        )


@QUANTIZATION_METHODS.register
class GPTQ(QuantizationMethod):
    """GPTQ's `quantization_config`: `bits` 4, `group_size` (-1: one group per row),
    `desc_act` (act-order), `sym` (either), `checkpoint_format` "gptq" or "gptq_v2",
    `lm_head` false. Per-module overrides (`dynamic`) are not supported."""

    name = "gptq"

    def __init__(self, config: dict | None, *, online: bool) -> None:
        super().__init__(config, online=online)
        c = self.config
        if c.get("bits", 4) != 4:
            raise ValueError(
                f"quantization_config bits: GPTQ with {c.get('bits')} bits is not supported (4)"
            )
        fmt = c.get("checkpoint_format", "gptq")
        if fmt not in ZERO_OFFSET:
            raise ValueError(
                f"quantization_config checkpoint_format: {fmt!r} is not supported "
                f"({', '.join(ZERO_OFFSET)})"
            )
        if c.get("lm_head"):
            raise ValueError("quantization_config lm_head: a quantized LM head is not supported")
        if c.get("dynamic"):
            raise ValueError(
                "quantization_config dynamic: per-module GPTQ overrides are not supported"
            )
        desc_act = c.get("desc_act", False)
        if not isinstance(desc_act, bool):
            raise ValueError(
                f"quantization_config desc_act must be true or false, got {desc_act!r}"
            )
        self.desc_act, self.zero_offset = desc_act, ZERO_OFFSET[fmt]
        self.group_size = c.get("group_size", 128)

    def linear_method(self, spec: LinearSpec, checkpoint_names: tuple[str, ...]):
        if not self.config:
            return Int4LinearMethod(spec, online_group_size(spec), None)
        group = group_size_of(spec, self.group_size)
        if self.online:
            return Int4LinearMethod(spec, group, None)
        checkpoint = GPTQCheckpoint(
            spec, group, desc_act=self.desc_act, zero_offset=self.zero_offset
        )
        return Int4LinearMethod(spec, group, checkpoint)
