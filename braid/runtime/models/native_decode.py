"""A Llama-family model's decode forward on the CPU in one native call, for models whose every
decoder projection runs torch's CPU int4 kernel (a GGUF file kept quantized: the embedded
SmolLM2 and the `.gguf` files braid keeps in blocks).

At batch 1 the Python forward of the embedded model spent about half its time in the small
torch calls between the int4 matmuls (docs/benchmarks.md, Quantization (CPU): the CPU step's
overhead); `braid.kernels.cpu_decode` runs the decoder layers, attention over the paged KV
pool included, as one C++ call that makes the same int4 kernel calls. The embedding and the
LM head stay in Python.

Chosen once, after the weights are in (`NativeCpuDecode.for_model`); a forward takes it only
for what it computes the same way (`__call__` returns None otherwise): decode rows of one
token each, the `torch_native` backend over a float32 pool, no draft-tree tails, no sliding
window that hides keys. The numbers are the Python path's up to the order of float32 sums
(`tests/runtime/test_native_decode.py`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from braid.runtime.attention.torch_native import TorchNativeBackend
from braid.runtime.forward_batch import ForwardBatch, ForwardMode
from braid.runtime.quantization.gguf_cpu import CPU_GROUP

logger = logging.getLogger("braid")

# Whether a model that can run the native CPU decode does (tests switch it off to compare).
ENABLED = True

# Feeds of `CpuInt4Weight` in the C++ source's numbering.
_FEEDS = {"same": 0, "twice": 1, "q6_k": 2}


def _segments(linear: Any) -> list[tuple[torch.Tensor, torch.Tensor, int, int]] | None:
    """(packed, table, rows, feed) per segment of a GGUF layer on the CPU int4 kernel."""
    method = getattr(linear, "method", None)
    weights = getattr(method, "cpu_int4_weights", lambda: None)()
    if not weights:
        return None
    return [(w.packed, w.table, w.table.shape[1], _FEEDS[w.feed]) for w in weights]


class NativeCpuDecode:
    """The decoder layers of one model as a `braid_cpu.CpuDecoder`; called with a forward's
    embeddings, rotary rows, batch and backend, it returns the final norm's output."""

    def __init__(self, decoder: Any) -> None:
        self.decoder = decoder
        self._pool: Any = None

    @classmethod
    def for_model(cls, model: Any) -> NativeCpuDecode | None:
        """For a `LlamaModel` built on the CPU in float32 whose every decoder projection runs
        the CPU int4 kernel, outside tensor parallelism; else None."""
        if not ENABLED or model.norm.weight.device.type != "cpu":
            return None
        if model.norm.weight.dtype != torch.float32 or not len(model.layers):
            return None
        first = model.layers[0]
        cfg_heads = first.self_attn
        norms: list[torch.Tensor] = []
        linears: list[int] = []
        packed: list[torch.Tensor] = []
        tables: list[torch.Tensor] = []
        biases: list[torch.Tensor] = []
        empty = torch.empty(0)
        for layer in model.layers:
            sa, mlp = layer.self_attn, layer.mlp
            if sa.o_proj.group is not None or mlp.down_proj.group is not None:
                return None  # tensor parallel: the projections' sums are all-reduced
            norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            if sa.qk_norm:
                norms += [sa.q_norm.weight, sa.k_norm.weight]
            for proj in (sa.qkv_proj, sa.o_proj, mlp.gate_up_proj, mlp.down_proj):
                segs = _segments(proj)
                if segs is None:
                    return None
                linears.append(len(segs))
                for p, t, rows, feed in segs:
                    packed.append(p)
                    tables.append(t)
                    linears += [rows, feed]
                bias = proj.bias
                biases.append(empty if bias is None else bias.detach().contiguous())
        norms.append(model.norm.weight)
        norms = [n.detach().contiguous() for n in norms]
        from braid.kernels.cpu_decode import load_cpu_decoder
        from braid.runtime.models.source import cache_root

        cls_native, line = load_cpu_decoder(cache_root() / "native")
        logger.info(line)
        if cls_native is None:
            return None
        inter = first.mlp.down_proj.in_features
        dims = [
            model.norm.weight.shape[0],
            cfg_heads.num_heads,
            cfg_heads.num_kv_heads,
            cfg_heads.head_dim,
            inter,
            len(model.layers),
            CPU_GROUP,
            int(cfg_heads.qk_norm),
        ]
        try:
            decoder = cls_native(dims, model.norm.eps, norms, linears, packed, tables, biases)
        except RuntimeError as e:  # a shape the native layers refuse (their TORCH_CHECKs)
            logger.info("native CPU decode not used for this model, the Python path runs: %s", e)
            return None
        return cls(decoder)

    def __call__(
        self,
        h: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        attn: Any,
    ) -> torch.Tensor | None:
        """The final norm's output for a decode batch it computes as the Python path does,
        else None (the caller runs the layers itself)."""
        if batch.mode is not ForwardMode.DECODE or type(attn) is not TorchNativeBackend:
            return None
        pool = attn.kv_pool
        if pool.dtype != torch.float32 or batch.tree_prefix is not None:
            return None
        window = attn.sliding_window
        if window is not None and int(batch.seq_lens.max()) > window:
            return None
        if pool is not self._pool:
            self.decoder.set_pool(pool.k, pool.v)
            self._pool = pool
        cos, sin = cos_sin
        rows = h.shape[0]
        return self.decoder.forward(
            h.contiguous(),
            cos.reshape(rows, -1).contiguous(),
            sin.reshape(rows, -1).contiguous(),
            attn.req_to_token.table,
            batch.req_pool_indices,
            batch.seq_lens,
            batch.out_cache_loc,
        )
