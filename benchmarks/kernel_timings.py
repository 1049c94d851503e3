"""Micro-benchmarks of braid's Triton kernels at Llama-3.1-8B shapes in bfloat16, each against
the torch code it replaces and, for the memory-bound ones, against the memory bound.

    python benchmarks/kernel_timings.py                      # needs a CUDA GPU
    python benchmarks/kernel_timings.py --kernels decode_attention,rmsnorm --repeats 50
    python benchmarks/kernel_timings.py --smoke              # tiny shapes, CPU interpreter: a check
                                                      # that the script runs, not a figure

Timing: CUDA events around `--per-repeat` back-to-back calls, `--repeats` times after a
warm-up call; the median per call is reported. `eager` includes each launch's host cost
(for small inputs the host, not the GPU, can be the limit); `graph` replays the same calls
captured in a CUDA graph, which is how decode steps run under graphs, so it is device time.
The bound is bytes moved / the measured device copy rate (`copy_bandwidth`: read + write per
second), for the kernels whose traffic is what limits them; extend attention instead reports
its FLOP rate and the bound from a measured bf16 matmul rate. Inputs are warm in L2 only
where they fit (the decode KV of large batches does not), except skinny_linear's weights,
which rotate through copies of at least 256 MiB in all so each call reads its weight from
HBM, as a decode step does. skinny_linear's torch side is also replayed from a graph and its
speedup is graph time over graph time: the plain kernel against `F.linear` (o_proj, batch 1:
measured equal, which is why plain linears stay on cuBLAS), and down_proj with the MLP's
activation fused in against the `silu_and_mul` kernel followed by `F.linear`, at batch 1 (what
the runtime fuses) and 16 (to decide whether it should); and qkv_proj and gate_up_proj at batch
1 with the RMSNorm before each (residual add included) fused in, against the `rmsnorm` kernel
followed by `F.linear`.

Writes benchmarks/results/kernels_cuda.json (or --out).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KERNELS = (
    "store_kv",
    "decode_attention",
    "extend_attention",
    "rmsnorm",
    "rotary",
    "silu_and_mul",
    "apply_token_bitmask_",
    "skinny_linear",
    "int4_gemv",
)

# Llama-3.1-8B (benchmarks/configs/llama-3.1-8b).
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 4096, 32, 8, 128
INTERMEDIATE, VOCAB, EPS = 14336, 128256, 1e-5
ROPE = dict(
    theta=500000.0,
    scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)


@dataclass
class Row:
    kernel: str
    case: str
    triton_us: float
    triton_graph_us: float | None
    torch_us: float | None
    torch_what: str
    bytes: int | None = None
    flops: int | None = None
    bound_us: float | None = None
    torch_graph_us: float | None = None

    @property
    def speedup(self) -> float | None:
        """torch time / Triton time: graph over graph where both were replayed, else eager."""
        if self.torch_graph_us is not None and self.triton_graph_us is not None:
            return self.torch_graph_us / self.triton_graph_us
        return None if self.torch_us is None else self.torch_us / self.triton_us

    @property
    def of_bound(self) -> float | None:
        """Bound time / kernel time (1.0 = at the bound), from the graph time if there is one."""
        t = self.triton_graph_us or self.triton_us
        return None if self.bound_us is None else self.bound_us / t


class Timer:
    def __init__(self, device: torch.device, repeats: int, per_repeat: int) -> None:
        self.device, self.repeats, self.per_repeat = device, repeats, per_repeat

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _median_us(self, run: Callable[[], None]) -> float:
        times = []
        for _ in range(self.repeats):
            if self.device.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            else:
                t0 = time.perf_counter()
                run()
                times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times) / self.per_repeat

    def eager(self, fn: Callable[[], object]) -> float:
        """Median microseconds per call of `fn`, launched eagerly."""
        fn()
        self._sync()

        def run() -> None:
            for _ in range(self.per_repeat):
                fn()

        return self._median_us(run)

    def graph(self, fn: Callable[[], object]) -> float | None:
        """Median microseconds per call of `fn` replayed from a CUDA graph (None off CUDA)."""
        if self.device.type != "cuda":
            return None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # compile and warm up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(self.per_repeat):
                fn()
        graph.replay()
        self._sync()
        return self._median_us(graph.replay)


@dataclass(frozen=True)
class Sizes:
    """Shapes per kernel; `smoke` shrinks everything so the CPU interpreter gets through."""

    smoke: bool

    def pick(self, real, tiny):
        return tiny if self.smoke else real

    @property
    def heads(self) -> tuple[int, int, int]:
        return self.pick((HEADS, KV_HEADS, HEAD_DIM), (4, 2, 16))

    @property
    def hidden(self) -> int:
        return self.pick(HIDDEN, 64)

    @property
    def intermediate(self) -> int:
        return self.pick(INTERMEDIATE, 96)

    @property
    def vocab(self) -> int:
        return self.pick(VOCAB, 1000)

    @property
    def token_counts(self) -> list[int]:
        return self.pick([1, 32, 256, 4096], [3])

    @property
    def decode_cases(self) -> list[tuple[int, int]]:
        """(batch, sequence length)."""
        return self.pick([(1, 4096), (32, 1024), (32, 4096), (64, 2048), (128, 1024)], [(2, 40)])

    @property
    def extend_cases(self) -> list[tuple[int, int, int]]:
        """(batch, cached prefix length, new tokens per request)."""
        return self.pick([(1, 0, 4096), (4, 1024, 1024), (16, 0, 512), (8, 3072, 128)], [(2, 5, 9)])

    @property
    def bitmask_batches(self) -> list[int]:
        return self.pick([1, 32, 256], [2])

    @property
    def linear_cases(self) -> list[tuple[str, int, int, int, str | None]]:
        """(projection, rows M, out features N, in features K, activation): o_proj plain at
        batch 1, and down_proj with silu_and_mul fused in at batch 1 and 16."""
        heads, _, d = self.heads
        h, inter = self.hidden, self.intermediate
        return [
            ("o_proj", 1, h, heads * d, None),
            ("down_proj", 1, h, inter, "silu_and_mul"),
            ("down_proj", 16, h, inter, "silu_and_mul"),
        ]

    @property
    def norm_linear_cases(self) -> list[tuple[str, int, int]]:
        """(projection, out features N, in features K) of the projections that follow an
        RMSNorm with a residual add, at batch 1: qkv_proj and gate_up_proj."""
        heads, kv_heads, d = self.heads
        h = self.hidden
        return [("qkv_proj", (heads + 2 * kv_heads) * d, h), ("gate_up", 2 * self.intermediate, h)]


def _paged_batch(batch, prefix, new, heads, kvh, d, dtype, device):
    """A one-layer pool holding `batch` requests of `prefix` cached tokens, `new` more to
    come, with both backends over it."""
    from braid.runtime.attention.torch_native import TorchNativeBackend
    from braid.runtime.attention.triton_backend import TritonBackend
    from braid.runtime.cache.memory_pool import KVPool, ReqToTokenPool

    total = prefix + new
    pool = KVPool(1, batch * total + 1, 1, kvh, d, dtype, device)
    pool.k[0].normal_()
    pool.v[0].normal_()
    table = ReqToTokenPool(batch, total, device)
    # Shuffled slots: a real pool after some churn is not laid out in order.
    slots = torch.randperm(batch * total, device=device).view(batch, total) + 1
    table.table.copy_(slots)
    kw = dict(num_heads=heads, num_kv_heads=kvh, head_dim=d)
    return pool, table, TorchNativeBackend(pool, table, **kw), TritonBackend(pool, table, **kw)


def _forward_batch(mode, batch, prefix, new, device):
    from braid.runtime.forward_batch import ForwardBatch

    seq = prefix + new
    rows = torch.arange(batch, device=device)
    positions = torch.arange(prefix, seq, device=device).repeat(batch)
    locs = torch.zeros_like(positions)  # K/V writes of the timed forwards go to padding slot 0
    return ForwardBatch(
        mode=mode,
        input_ids=torch.zeros_like(positions),
        positions=positions,
        out_cache_loc=locs,
        req_pool_indices=rows,
        seq_lens=torch.full((batch,), seq, device=device),
        prefix_lens=[prefix] * batch,
        extend_lens=[new] * batch,
        logits_indices=rows,
    )


def bench_store_kv(sz: Sizes, t: Timer, dtype, device) -> list[Row]:
    from braid.kernels import store_kv
    from braid.kernels.kv_store import store_kv_reference

    _, kvh, d = sz.heads
    slots = sz.pick(200_000, 64)
    k_cache = torch.zeros(slots, kvh, d, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    rows = []
    for n in sz.token_counts:
        k = torch.randn(n, kvh, d, dtype=dtype, device=device)
        v = torch.randn_like(k)
        loc = torch.randperm(slots, device=device)[:n]
        nbytes = 2 * 2 * k.numel() * k.element_size() + loc.numel() * 8
        rows.append(
            Row(
                "store_kv",
                f"tokens={n}",
                t.eager(partial(store_kv, k_cache, v_cache, k, v, loc)),
                t.graph(partial(store_kv, k_cache, v_cache, k, v, loc)),
                t.eager(partial(store_kv_reference, k_cache, v_cache, k, v, loc)),
                "index_put (KVPool.store)",
                bytes=nbytes,
            )
        )
    return rows


def bench_decode(sz: Sizes, t: Timer, dtype, device) -> list[Row]:
    from braid.kernels import decode_attention
    from braid.kernels.attention_decode import workspace_numel
    from braid.runtime.forward_batch import ForwardMode

    heads, kvh, d = sz.heads
    rows = []
    for batch, seq in sz.decode_cases:
        pool, table, native, triton_be = _paged_batch(
            batch, seq - 1, 1, heads, kvh, d, dtype, device
        )
        fb = _forward_batch(ForwardMode.DECODE, batch, seq - 1, 1, device)
        q = torch.randn(batch, heads, d, dtype=dtype, device=device)
        k = torch.randn(batch, kvh, d, dtype=dtype, device=device)
        v = torch.randn_like(k)
        splits = triton_be.kv_splits_for(batch)
        out = torch.empty_like(q)
        ws = torch.empty(workspace_numel(batch, heads, d, splits), device=device)
        kernel = partial(
            decode_attention,
            *(q, pool.k[0], pool.v[0], table.table, fb.req_pool_indices, fb.seq_lens, d**-0.5),
            num_kv_splits=splits,
            out=out,
            workspace=ws,
        )

        native.init_forward_metadata(fb)
        kv_bytes = 2 * batch * seq * kvh * d * pool.k[0].element_size()
        nbytes = kv_bytes + batch * seq * 8 + 2 * q.numel() * q.element_size()
        rows.append(
            Row(
                "decode_attention",
                f"batch={batch} seq={seq} splits={splits}",
                t.eager(kernel),
                t.graph(kernel),
                t.eager(partial(native.forward, q, k, v, 0, fb)),
                "torch_native backend forward (gather + SDPA)",
                bytes=nbytes,
            )
        )
    return rows


def bench_extend(sz: Sizes, t: Timer, dtype, device) -> list[Row]:
    from braid.kernels import extend_attention
    from braid.runtime.forward_batch import ForwardMode

    heads, kvh, d = sz.heads
    rows = []
    for batch, prefix, new in sz.extend_cases:
        pool, table, native, triton_be = _paged_batch(
            batch, prefix, new, heads, kvh, d, dtype, device
        )
        fb = _forward_batch(ForwardMode.EXTEND, batch, prefix, new, device)
        n = batch * new
        q = torch.randn(n, heads, d, dtype=dtype, device=device)
        k = torch.randn(n, kvh, d, dtype=dtype, device=device)
        v = torch.randn_like(k)
        triton_be.init_forward_metadata(fb)
        m = fb.attn_metadata
        out = torch.empty_like(q)

        kernel = partial(
            extend_attention,
            *(q, k, v, pool.k[0], pool.v[0], table.table, m.req_pool_indices),
            *(m.prefix_lens, m.extend_lens, m.extend_start_loc, d**-0.5),
            out=out,
            max_extend_len=m.max_extend_len,
        )

        native.init_forward_metadata(fb)
        # QK^T and PV: 2 matmuls x 2 flops per multiply-add over the visible (causal) keys.
        visible = batch * heads * (new * prefix + new * (new + 1) // 2)
        rows.append(
            Row(
                "extend_attention",
                f"batch={batch} prefix={prefix} new={new}",
                t.eager(kernel),
                None,
                t.eager(partial(native.forward, q, k, v, 0, fb)),
                "torch_native backend forward (SDPA per request)",
                flops=4 * d * visible,
            )
        )
    return rows


def bench_rmsnorm(sz: Sizes, t: Timer, dtype, device) -> list[Row]:
    from braid.kernels import rmsnorm
    from braid.kernels.norm import rmsnorm_reference

    h = sz.hidden
    w = torch.randn(h, dtype=dtype, device=device)
    rows = []
    for n in sz.token_counts:
        x = torch.randn(n, h, dtype=dtype, device=device)
        r = torch.randn_like(x)
        rows.append(
            Row(
                "rmsnorm",
                f"tokens={n} hidden={h} +residual",
                t.eager(partial(rmsnorm, x, w, EPS, r)),
                t.graph(partial(rmsnorm, x, w, EPS, r)),
                t.eager(partial(rmsnorm_reference, x, w, EPS, r)),
                "RMSNorm module math (eager torch)",
                bytes=4 * x.numel() * x.element_size() + w.numel() * w.element_size(),
            )
        )
    return rows


def bench_rotary(sz: Sizes, t: Timer, dtype, device) -> list[Row]:
    from braid.kernels import rotary
    from braid.runtime.layers.rotary import RotaryEmbedding, apply_rotary

    heads, kvh, d = sz.heads
    rope = RotaryEmbedding(d, sz.pick(131072, 64), ROPE["theta"], ROPE["scaling"], dtype)
    rope = rope.to(device)
    cache = (rope.cos, rope.sin)

    def torch_rotary(q, k, pos):
        return apply_rotary(q, k, *rope.lookup(pos))

    rows = []
    for n in sz.token_counts:
        q = torch.randn(n, heads, d, dtype=dtype, device=device)
        k = torch.randn(n, kvh, d, dtype=dtype, device=device)
        pos = torch.randint(0, rope.cos.shape[0], (n,), device=device)
        nbytes = 2 * (q.numel() + k.numel()) * q.element_size() + n * d * rope.cos.element_size()
        rows.append(
            Row(
                "rotary",
                f"tokens={n} (in place)",
                t.eager(partial(rotary, q, k, pos, cache)),
                t.graph(partial(rotary, q, k, pos, cache)),
                t.eager(partial(torch_rotary, q, k, pos)),
                "lookup + apply_rotary (eager torch, out of place)",
                bytes=nbytes,
            )
        )
    return rows


def bench_silu_and_mul(sz: Sizes, t: Timer, dtype, device) -> list[Row]:
    from braid.kernels import silu_and_mul
    from braid.kernels.activation import silu_and_mul_reference

    rows = []
    for n in sz.token_counts:
        x = torch.randn(n, 2 * sz.intermediate, dtype=dtype, device=device)
        rows.append(
            Row(
                "silu_and_mul",
                f"tokens={n} d={sz.intermediate}",
                t.eager(partial(silu_and_mul, x)),
                t.graph(partial(silu_and_mul, x)),
                t.eager(partial(silu_and_mul_reference, x)),
                "layers.activation.silu_and_mul (eager torch)",
                bytes=3 * x.numel() // 2 * x.element_size(),
            )
        )
    return rows


def bench_bitmask(sz: Sizes, t: Timer, dtype, device) -> list[Row]:
    from braid.kernels import apply_token_bitmask_
    from braid.kernels.token_bitmask import apply_token_bitmask_reference

    vocab = sz.vocab
    words = -(-vocab // 32)
    rows = []
    for batch in sz.bitmask_batches:
        # Logits stay float32 as the sampler keeps them.
        logits = torch.randn(batch, vocab, dtype=torch.float32, device=device)
        mask = torch.randint(-(2**31), 2**31 - 1, (batch, words), dtype=torch.int32, device=device)
        rows.append(
            Row(
                "apply_token_bitmask_",
                f"batch={batch} vocab={vocab}",
                t.eager(partial(apply_token_bitmask_, logits, mask)),
                t.graph(partial(apply_token_bitmask_, logits, mask)),
                t.eager(partial(apply_token_bitmask_reference, logits, mask)),
                "unpack bits + masked_fill (eager torch)",
                bytes=2 * logits.numel() * 4 + mask.numel() * 4,
            )
        )
    return rows


# Weight bytes each skinny_linear case cycles through: several times an H200's 50 MB L2.
COLD_WEIGHT_BYTES = 256 << 20


def _rotating(fn: Callable, x: torch.Tensor, weights: list[torch.Tensor]) -> Callable[[], object]:
    """`fn(x, w)` with the next of `weights` at each call (a fresh cycle per timing)."""
    ws = itertools.cycle(weights)
    return lambda: fn(x, next(ws))


def _norm_then_linear(
    x: torch.Tensor, w: torch.Tensor, *, norm_weight: torch.Tensor, residual: torch.Tensor
) -> torch.Tensor:
    """The unfused form of a norm-fused skinny_linear: the `rmsnorm` kernel, then cuBLAS."""
    import torch.nn.functional as F

    from braid.kernels import rmsnorm

    return F.linear(rmsnorm(x, norm_weight, EPS, residual)[0], w)


def bench_skinny_linear(sz: Sizes, t: Timer, dtype, device) -> list[Row]:
    import torch.nn.functional as F

    from braid.kernels import silu_and_mul, skinny_linear

    def unfused(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(silu_and_mul(x), w)

    rows = []
    for name, m, n, k, activation in sz.linear_cases:
        w_bytes = n * k * torch.finfo(dtype).bits // 8
        copies = max(1, math.ceil(sz.pick(COLD_WEIGHT_BYTES, 0) / w_bytes))
        weights = [torch.randn(n, k, dtype=dtype, device=device) / k**0.5 for _ in range(copies)]
        x = torch.randn(m, k if activation is None else 2 * k, dtype=dtype, device=device)
        if activation is None:
            kernel, torch_fn, case = skinny_linear, F.linear, ""
            torch_what = "F.linear (cuBLAS); speedup from graph times"
        else:
            kernel, torch_fn = partial(skinny_linear, activation=activation), unfused
            case = " fused"  # the case column is 36 wide
            torch_what = f"{activation} kernel + F.linear (cuBLAS); speedup from graph times"
        rows.append(
            Row(
                "skinny_linear",
                f"{name} M={m} N={n} K={k}{case}",
                t.eager(_rotating(kernel, x, weights)),
                t.graph(_rotating(kernel, x, weights)),
                t.eager(_rotating(torch_fn, x, weights)),
                torch_what,
                bytes=w_bytes + (x.numel() + m * n) * x.element_size(),
                torch_graph_us=t.graph(_rotating(torch_fn, x, weights)),
            )
        )
    for name, n, k in sz.norm_linear_cases:
        w_bytes = n * k * torch.finfo(dtype).bits // 8
        copies = max(1, math.ceil(sz.pick(COLD_WEIGHT_BYTES, 0) / w_bytes))
        weights = [torch.randn(n, k, dtype=dtype, device=device) / k**0.5 for _ in range(copies)]
        x, residual = (torch.randn(1, k, dtype=dtype, device=device) for _ in range(2))
        norm_weight = torch.randn(k, dtype=dtype, device=device)
        residual_out = torch.empty_like(x)
        fused = partial(
            skinny_linear,
            norm_weight=norm_weight,
            eps=EPS,
            residual=residual,
            residual_out=residual_out,
        )
        norm_then_linear = partial(_norm_then_linear, norm_weight=norm_weight, residual=residual)

        rows.append(
            Row(
                "skinny_linear",
                f"{name} M=1 N={n} K={k} norm+res",
                t.eager(_rotating(fused, x, weights)),
                t.graph(_rotating(fused, x, weights)),
                t.eager(_rotating(norm_then_linear, x, weights)),
                "rmsnorm kernel (+residual) + F.linear (cuBLAS); speedup from graph times",
                # The weight, plus x, residual and the norm weight read, new residual and out
                # written (the unfused path also writes and reads back the normalised row).
                bytes=w_bytes + (4 * k + n) * x.element_size(),
                torch_graph_us=t.graph(_rotating(norm_then_linear, x, weights)),
            )
        )
    return rows


def bench_int4_gemv(sz: Sizes, t: Timer, dtype, device) -> list[Row]:
    """One-row int4 GEMVs (group 128, cold weights) at each projection: the packed form against
    the float32 form (each at its table configuration, `quant_gemv.config_for`, packed forced
    for the first), and the packed form with the norm (residual add included) or the activation
    fused in against the `rmsnorm` / `silu_and_mul` kernel followed by the packed GEMV."""
    heads, kv_heads, d = sz.heads
    # The smoke sizes' K must be whole 128-input blocks (the packed form's groups).
    h, inter = sz.pick(sz.hidden, 128), sz.pick(sz.intermediate, 256)
    cases = [
        ("qkv_proj", (heads + 2 * kv_heads) * d, h, "norm"),
        ("o_proj", h, h, None),
        ("gate_up", 2 * inter, h, "norm"),
        ("down_proj", h, inter, "silu_and_mul"),
    ]
    return [row for case in cases for row in _int4_case(*case, sz, t, dtype, device)]


def _int4_case(name, n, k, prologue, sz: Sizes, t: Timer, dtype, device) -> list[Row]:
    from dataclasses import replace

    from braid.kernels import rmsnorm, silu_and_mul
    from braid.kernels.int4_gemv import int4_gemv
    from braid.kernels.quant_gemv import GemvWorkspace, config_for
    from braid.kernels.quant_reference import pack_int4_meta

    rows = []
    group = 128
    w_bytes = n * k // 2 + 4 * n * (k // group)
    copies = max(1, math.ceil(sz.pick(COLD_WEIGHT_BYTES, 0) / w_bytes))
    meta = pack_int4_meta(
        torch.rand(k // group, n, device=device).half() / 64,
        torch.randint(0, 16, (k // group, n), device=device).to(torch.uint8),
    )
    weights = [
        torch.randint(-(2**31), 2**31 - 1, (n, -(-k // 128) * 16), dtype=torch.int32,
                      device=device)
        for _ in range(copies)
    ]  # fmt: skip
    cfg = config_for("int4", n, k, device)
    packed_cfg, plain_cfg = replace(cfg, packed=True), replace(cfg, packed=False)
    ws = GemvWorkspace(device, cfg.split_k * n, -(-n // cfg.block_n))

    def gemv(x, q, c):
        return int4_gemv(x, q, meta, group, config=c, workspace=ws)

    x = torch.randn(1, k, dtype=dtype, device=device)
    packed, plain = partial(gemv, c=packed_cfg), partial(gemv, c=plain_cfg)
    bytes_ = w_bytes + 2 * (k + n) * x.element_size()
    rows.append(
        Row("int4_gemv", f"{name} N={n} K={k} packed", t.eager(_rotating(packed, x, weights)),
            t.graph(_rotating(packed, x, weights)), t.eager(_rotating(plain, x, weights)),
            "the float32 form; speedup from graph times", bytes=bytes_,
            torch_graph_us=t.graph(_rotating(plain, x, weights)))
    )  # fmt: skip
    if prologue is None:
        return rows
    if prologue == "norm":
        residual, norm_weight = torch.randn_like(x), torch.randn(k, dtype=dtype, device=device)
        new = torch.empty_like(x)
        args = dict(norm_weight=norm_weight, eps=EPS, residual=residual, residual_out=new)

        def fused(x, q, args=args):
            return int4_gemv(x, q, meta, group, config=packed_cfg, workspace=ws, **args)

        def unfused(x, q, norm_weight=norm_weight, residual=residual):
            return packed(rmsnorm(x, norm_weight, EPS, residual)[0], q)

        xin, what = x, "rmsnorm kernel (+residual) + the packed GEMV"
    else:

        def fused(x, q):
            return int4_gemv(x, q, meta, group, activation=prologue, config=packed_cfg,
                             workspace=ws)  # fmt: skip

        def unfused(x, q):
            return packed(silu_and_mul(x), q)

        xin, what = torch.randn(1, 2 * k, dtype=dtype, device=device), "silu_and_mul + GEMV"
    rows.append(
        Row("int4_gemv", f"{name} N={n} K={k} {prologue} fused",
            t.eager(_rotating(fused, xin, weights)), t.graph(_rotating(fused, xin, weights)),
            t.eager(_rotating(unfused, xin, weights)), what + "; speedup from graph times",
            bytes=bytes_, torch_graph_us=t.graph(_rotating(unfused, xin, weights)))
    )  # fmt: skip
    return rows
    return rows


BENCHES = {
    "store_kv": bench_store_kv,
    "decode_attention": bench_decode,
    "extend_attention": bench_extend,
    "rmsnorm": bench_rmsnorm,
    "rotary": bench_rotary,
    "silu_and_mul": bench_silu_and_mul,
    "apply_token_bitmask_": bench_bitmask,
    "skinny_linear": bench_skinny_linear,
    "int4_gemv": bench_int4_gemv,
}


def _fmt(x: float | None, spec: str) -> str:
    """`x` formatted by `spec` ("9.1f"), or a dash in the same width."""
    if x is None:
        return "-".rjust(int(spec.split(".")[0]))
    return format(x, spec)


def print_table(rows: list[Row]) -> None:
    head = (
        f"{'kernel':<20} {'case':<36} {'triton us':>10} {'graph us':>9} {'torch us':>10} "
        f"{'t.graph us':>10} {'speedup':>7} {'bound us':>9} {'of bound':>8} {'TFLOP/s':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        t = r.triton_graph_us or r.triton_us
        tflops = None if r.flops is None else r.flops / (t * 1e-6) / 1e12
        print(
            f"{r.kernel:<20} {r.case:<36} {r.triton_us:10.1f} {_fmt(r.triton_graph_us, '9.1f')} "
            f"{_fmt(r.torch_us, '10.1f')} {_fmt(r.torch_graph_us, '10.1f')} "
            f"{_fmt(r.speedup, '7.2f')} {_fmt(r.bound_us, '9.1f')} "
            f"{_fmt(r.of_bound, '8.0%')} {_fmt(tflops, '8.1f')}"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated subset")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--repeats", type=int, default=20, help="timed repeats (median kept)")
    ap.add_argument("--per-repeat", type=int, default=10, help="back-to-back calls per repeat")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU (interpreter)")
    ap.add_argument("--out", default=None, help="JSON path (with --smoke: only if given)")
    args = ap.parse_args(argv)
    unknown = set(args.kernels.split(",")) - set(KERNELS)
    if unknown:
        ap.error(f"unknown kernels {sorted(unknown)}; have {', '.join(KERNELS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    has_cuda = torch.cuda.is_available()
    if not has_cuda and not args.smoke:
        sys.exit(
            "benchmarks/kernel_timings.py measures Triton kernels on a CUDA GPU, and this machine "
            "has none (torch.cuda.is_available() is False). Run it on the GPU machine, or pass "
            "--smoke to check on CPU that the script runs (no figures)."
        )
    if not has_cuda:
        # Before the first kernel module is imported: @triton.jit picks interpreted then.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from benchmarks.common import copy_bandwidth, matmul_rate, write_result

    device = torch.device("cuda" if has_cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    if args.smoke and not has_cuda:
        dtype = torch.float16  # the interpreter's bfloat16 arithmetic is wrong
    sz = Sizes(smoke=args.smoke)
    timer = Timer(
        device, args.repeats if not args.smoke else 1, 1 if args.smoke else args.per_repeat
    )
    torch.manual_seed(0)
    if args.smoke:
        bw = {"bytes_per_s": None}
        mm = {"flops_per_s": None}
    else:
        bw = copy_bandwidth(device.type)
        mm = matmul_rate(device.type, dtype=dtype)
    rows: list[Row] = []
    with torch.inference_mode():
        for name in args.kernels.split(","):
            rows.extend(BENCHES[name](sz, timer, dtype, device))
            if has_cuda:
                torch.cuda.empty_cache()
    for r in rows:
        if r.bytes is not None and bw["bytes_per_s"]:
            r.bound_us = r.bytes / bw["bytes_per_s"] * 1e6
        elif r.flops is not None and mm["flops_per_s"]:
            r.bound_us = r.flops / mm["flops_per_s"] * 1e6
    if not args.smoke:
        print(
            f"device copy rate {bw['bytes_per_s'] / 1e9:.0f} GB/s (read + write), "
            f"{str(dtype).removeprefix('torch.')} matmul {mm['flops_per_s'] / 1e12:.0f} TFLOP/s"
        )
    print_table(rows)
    fields = {
        "dtype": str(dtype).removeprefix("torch."),
        "smoke": args.smoke,
        "shapes": "Llama-3.1-8B" if not args.smoke else "tiny",
        "repeats": timer.repeats,
        "per_repeat": timer.per_repeat,
        "copy_bandwidth": bw,
        "matmul_rate": mm,
        "rows": [{**asdict(r), "speedup": r.speedup, "of_bound": r.of_bound} for r in rows],
    }
    if args.smoke and args.out is None:
        return  # smoke figures are not results: written only where --out asks
    write_result("kernels", device.type, args.out, fields)


if __name__ == "__main__":
    main()
