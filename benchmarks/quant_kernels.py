"""The quantized linear kernels, one by one, at Llama-3.1-8B's layer shapes: every variant and
launch configuration timed, checked against its torch reference, and the fastest correct one
per shape and row count recorded for the runtime's tables.

    python benchmarks/quant_kernels.py            # H200: about 3-4 minutes
    python benchmarks/quant_kernels.py --smoke    # toy shapes on the CPU (TRITON_INTERPRET=1)

Shapes (N x K): qkv 6144 x 4096, o 4096 x 4096, gate_up 28672 x 4096, down 4096 x 14336, at
M = 1, 16, 128 and 8192 rows of bfloat16 activations. Variants per method:

- bf16: `F.linear` (cuBLAS), the baseline.
- int4 (group 128, AWQ's float16 scales): M = 1, `int4_gemv` over a sweep of GemvConfigs and
  the previous `int4_linear`; M > 1, `int4_planar_linear` (a few tiles) and "dequant+cublas"
  (`dequantize_int4_planar` to bf16, then `F.linear`), and `int4_linear` below 8192 rows.
- int8: M = 1, `int8_gemv` sweep and `int8_linear`; M > 1, `int8_linear`.
- fp8 (per-channel weights, per-token activations): M = 1, `fp8_gemv` sweep and
  `per_token_quant_fp8` + `torch._scaled_mm`; M > 1, the latter, also with `use_fast_accum`.
- int4_ahead (M = 1): the packed int4 GEMV over inputs packed ahead (`pack_int4_inputs`, made
  once per x outside the timed calls): loading x's float16 pairs as words instead of making
  them in every program. Against int4's packed sweep: what the GEMV spends on x. Also
  "pack+ahead:table": the packing's own launch and the GEMV at the table's configuration
  (`config_for("int4_ahead")`, the runtime's), both timed (whether a launch of its own pays).
- fp8_ahead (M = 1): the fp8 GEMV over `per_token_quant_fp8(x)`'s codes and scale made once per
  x outside the timed calls, instead of every program reading the row for its scale and
  rounding its inputs. Against fp8's sweep: what the GEMV spends on x. Also
  "quant+ahead:table": the quantization's own launch and the GEMV at the table's
  configuration (`config_for("fp8_ahead")`, the runtime's), both timed.
- read_int4_rows (M = 1): the int4 GEMV's own loads without its arithmetic: the planar codes
  and the meta words loaded by (row block, split) programs tile by tile as `int4_gemv` loads
  them, at each configuration of its packed sweep and at a few long runs of each row,
  xor'ed (`benchmarks/read_floor.py`). Between the read floor below and the GEMV: what its
  access pattern costs, apart from its arithmetic and its split-K reduction.
- read_bf16, read_int4, read_int8, read_fp8 (M = 1): the read floor. A kernel that only reads
  as many bytes as that method's layer (int32 words, xor'ed: `read_floor.read_words`) over a
  sweep of program counts (`p`: the programs asked for; at most that many run, each a whole
  number of tiles) and tile sizes, timed as the GEMVs are (cold, in graphs, launch gaps and
  tails included): what any one-row kernel over those bytes costs at that size. The summary
  gives each GEMV's time over its method's floor.

Timing: every variant first runs once (compiles, tunes) and is checked: ‖out - ref‖ / ‖ref‖
against the method's torch reference in float32 must stay under 2e-2 (bf16 output rounding is
~4e-3), and fp8's activation codes must be the reference's bit for bit. Then each call reads a
different copy of the weights (copies of at least 256 MiB in all, so weights come from HBM, as
in decode), a CUDA graph replays `--calls` such calls, and the median over `--repeats` replays
(CUDA events) per call is the time. Bytes are the weights' (codes, scales, zeros) plus the
activations in and out; `of_copy` is bytes / time / the device copy rate measured in this run
(bytes read + written per second, benchmarks.common.copy_bandwidth); at 8192 rows `tflops`
is 2 M N K / time, `mfu` that over the bf16 matmul rate measured here (fp8: its _scaled_mm
rate).

Prints one table, last: per shape and M the fastest correct variant of each method, its time,
its fraction of the copy rate (M <= 128) or MFU (8192), the bf16 time beside it and, where the
read floor of its bytes was measured, its time over that floor; then the
tables to paste into braid/kernels/quant_gemv.py (INT4_CONFIGS, INT8_CONFIGS, FP8_CONFIGS)
and quant_planar.py (DEQUANTIZE_MIN_ROWS). Writes benchmarks/results/quant_kernels_cuda.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 16, 128, 8192)
GROUP = 128
COLD_BYTES = 256 << 20
MAX_ERROR = 2e-2

# M = 1 sweeps: GemvConfig(block_n, block_k, split_k, warps, stages). int4's tiles keep at most
# 4 rows a thread and its accumulators in registers (checked with Triton 3.6 for sm_90: no
# spills); int8's and fp8's keep block_n * block_k / threads <= 128 float32 accumulators.
INT4_SWEEP = [
    (128, 128, 1, 4, 3),
    (128, 256, 1, 4, 2),
    (128, 256, 2, 4, 2),
    (128, 256, 4, 4, 2),
    (128, 256, 8, 4, 2),
    (256, 128, 4, 4, 2),
    (256, 128, 8, 4, 3),
    (64, 256, 4, 2, 2),
    (128, 256, 8, 2, 2),
    (64, 512, 8, 2, 2),
    # Deeper pipelines at the float32 form's H100 pick for gate_up (128, 256, 4, 4, 2): at 250
    # registers two programs share an SM, one tile each in flight with 2 stages.
    (128, 256, 4, 4, 3),
    (128, 256, 4, 4, 4),
    (128, 128, 4, 4, 4),
]
# int4 in float16 pairs (GemvConfig.packed, `int4_gemv`; each in both packed forms, and with
# the splits launched first): 8 or 16 rows a thread (its per-row scale and zero and
# per-column input scaling shared by more words), and K split until the small layers have
# 128-256 programs.
INT4_PACKED_SWEEP = [
    (512, 128, 4, 4, 2),
    (512, 128, 8, 4, 2),
    (512, 128, 16, 4, 2),
    (512, 128, 8, 4, 3),
    (1024, 128, 8, 8, 2),
    (256, 128, 8, 4, 3),
    (256, 128, 16, 4, 2),
    (256, 128, 32, 4, 2),
    (256, 256, 4, 4, 2),
    (256, 256, 8, 4, 2),
    (128, 128, 16, 4, 2),
    (512, 128, 28, 4, 2),
    # More loads in flight (the H100 run of 2026-12-05 put both forms within 6% of each other:
    # not bound by issue): deeper pipelines and longer steps at the tiles that won there.
    (128, 128, 16, 4, 3),
    (128, 128, 16, 4, 4),
    (256, 128, 16, 4, 3),
    (128, 256, 8, 4, 2),
    (128, 256, 8, 4, 3),
    (256, 128, 4, 4, 4),
    (512, 128, 4, 4, 3),
]
BYTE_SWEEP = [
    (16, 512, 1, 4, 3),
    (16, 512, 2, 4, 2),
    (32, 512, 1, 4, 2),
    (32, 512, 2, 4, 2),
    (32, 512, 4, 4, 2),
    (64, 256, 2, 4, 3),
    (64, 256, 4, 4, 3),
    (16, 1024, 4, 4, 2),
    (32, 256, 8, 2, 3),
]
# fp8 on the tensor cores (GemvConfig.dot): tiles of 64 or 128 rows, the narrowest the
# H100/H200 tensor-core product takes along N, with K split until the small layers fill the GPU.
FP8_DOT_SWEEP = [
    (64, 128, 1, 4, 4),
    (64, 256, 1, 4, 3),
    (64, 256, 2, 4, 3),
    (64, 256, 4, 4, 3),
    (64, 256, 8, 4, 3),
    (64, 512, 1, 4, 3),
    (64, 512, 2, 4, 2),
    (64, 512, 4, 4, 2),
    (128, 128, 4, 4, 4),
    (128, 256, 1, 4, 3),
    (128, 256, 2, 8, 3),
    (128, 256, 4, 4, 3),
]
PLANAR_SWEEP = {
    16: [(16, 64, 4, 3), (16, 128, 4, 3), (16, 32, 4, 4)],
    128: [(64, 64, 4, 3), (128, 64, 8, 3), (64, 128, 8, 3)],
}
# The read floor (`_read_kernel`): (int32 words per loop step, warps, stages) x programs as
# multiples of the SM count (below 1: how fast a part of the SMs reads, for sharing the GPU
# between a memory-bound and a compute-bound kernel).
READ_SWEEP = [(1024, 4, 1), (1024, 4, 3), (4096, 4, 1), (4096, 8, 3)]
READ_WAVES = (0.25, 0.5, 1, 2, 4, 8, 16)
# The GEMV's loads alone (`_read_rows_kernel`) also with long runs of each row (whole rows or
# halves of them a program, few rows a program): whether the row pattern itself costs.
READ_ROWS_LONG = [
    (16, 512, 1, 4, 3),
    (32, 512, 1, 4, 3),
    (16, 1024, 1, 4, 2),
    (32, 512, 2, 4, 3),
    (64, 512, 2, 4, 3),
    (64, 256, 4, 4, 3),
]
READ_METHODS = ("read_bf16", "read_int4", "read_int8", "read_fp8", "read_int4_rows")
AHEAD = {"int4_ahead": "int4", "fp8_ahead": "fp8"}  # inputs made ahead: over whose weights
# The one-row launch shapes `--write-config` records, by `config_for` kind (the GEMVs over
# inputs made ahead have their own: no program prepares x there, so other tiles win).
CONFIG_KINDS = ("int4", "int8", "fp8", "int4_ahead", "fp8_ahead")
WEIGHTS_OF = {"read_int4_rows": "int4", **AHEAD}  # methods over another method's weights
SMOKE = dict(shapes={"a": (64, 256), "b": (48, 384)}, rows=(1, 3, 40))


class Bench:
    """Times callables on one device: CUDA graphs of `calls` calls, median of `repeats`."""

    def __init__(self, device: torch.device, calls: int, repeats: int) -> None:
        self.device, self.calls, self.repeats = device, calls, repeats

    def per_call_us(self, fn: Callable[[int], object], graph: bool) -> float:
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            for i in range(self.calls):
                fn(i)
            return (time.perf_counter() - t0) / self.calls * 1e6
        for i in range(2):
            fn(i)
        torch.cuda.synchronize()
        run: Callable[[], None]
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for i in range(self.calls):
                    fn(i)
            run = g.replay
        else:

            def run() -> None:
                for i in range(self.calls):
                    fn(i)

        run()
        times = []
        for _ in range(self.repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / self.calls)
        return statistics.median(times)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def make_weights(
    n: int, k: int, device: torch.device, copies: int, gen: torch.Generator, methods: list[str]
) -> dict:
    """Random weights of every method for an [n, k] layer, `copies` of each (for cold reads);
    the read floor's words only for the `methods` that read them."""
    from braid.kernels.quant_reference import (
        FP8_DTYPE,
        pack_int4,
        pack_int4_meta,
        pack_int4_planar,
    )

    def rand_int(lo, hi, shape):
        return torch.randint(lo, hi, shape, generator=gen, device=device)

    out: dict[str, list] = {"bf16": [], "int4": [], "int8": [], "fp8": []}
    for _ in range(copies):
        out["bf16"].append(torch.randn(n, k, generator=gen, device=device).bfloat16() * 0.02)
        q = pack_int4(rand_int(0, 16, (n, k)))
        s = ((torch.rand(k // GROUP, n, generator=gen, device=device) + 0.5) / (4 * k**0.5)).half()
        z = rand_int(0, 16, (k // GROUP, n)).to(torch.uint8)
        out["int4"].append((q, s, z, pack_int4_planar(q), pack_int4_meta(s, z)))
        w8 = rand_int(-127, 128, (n, k)).to(torch.int8)
        s8 = (torch.rand(n, generator=gen, device=device) + 0.5) / (64 * k**0.5)
        out["int8"].append((w8, s8))
        wf = (torch.randn(n, k, generator=gen, device=device) * 0.5).to(FP8_DTYPE)
        out["fp8"].append((wf, torch.rand(n, generator=gen, device=device) / 100 + 1e-3))
    for method in READ_METHODS:
        if method == "read_int4_rows" or method not in methods:  # that one reads int4's
            continue
        words = weight_bytes(method, n, k) // 4
        out[method] = [
            torch.randint(
                -(2**31), 2**31 - 1, (words,), generator=gen, device=device, dtype=torch.int32
            )  # fmt: skip
            for _ in range(copies)
        ]
    return out


def weight_bytes(method: str, n: int, k: int) -> int:
    method = method.removeprefix("read_").removesuffix("_rows").removesuffix("_ahead")
    per = {"bf16": 2.0, "int4": 0.5, "int8": 1.0, "fp8": 1.0}[method]
    meta = {"int4": 4 * n * (k // GROUP), "int8": 4 * n, "fp8": 4 * n}.get(method, 0)
    return int(n * k * per) + meta


def variants(method: str, m: int, smoke: bool) -> list[tuple[str, Callable]]:
    """(name, call(x, weights, out)) of every variant of `method` at M = m."""
    import torch.nn.functional as F

    from benchmarks.read_floor import read_rows, read_words
    from braid.kernels.fp8_quant import per_token_quant_fp8
    from braid.kernels.int4_gemv import int4_gemv
    from braid.kernels.int4_pairs import pack_int4_inputs
    from braid.kernels.quant_gemm import int4_linear, int8_linear
    from braid.kernels.quant_gemv import GemvConfig, config_for, fp8_gemv, int8_gemv
    from braid.kernels.quant_planar import dequantize_int4_planar, int4_planar_linear

    def cfg_name(c):
        packed = int(c[6]) if len(c) > 6 else 0
        flags = ("_dot" if len(c) > 5 and c[5] else "") + ("", "_f16x2", "_f16x2z")[packed]
        flags += "_sf" if len(c) > 7 and c[7] else ""
        return "bn{}_bk{}_split{}_w{}_s{}".format(*c) + flags

    def and_splits_first(sweep):
        """Each split configuration also with its splits launched first (`splits_first`)."""
        full = [(*c, *(False,) * (7 - len(c))) for c in sweep]
        return full + [(*c, True) for c in full if c[2] > 1]

    def once_per_x(prepare):
        """`prepare(x)`, made on x's first call (outside the timed calls) and kept."""
        made: dict = {}

        def get(x):
            if id(x) not in made:
                made[id(x)] = prepare(x)
            return made[id(x)]

        return get

    def to16(x):  # the smoke run's float32 x goes to the packed forms as bfloat16
        return x.bfloat16() if x.dtype == torch.float32 else x

    # The one-row sweeps of the packed int4 forms and of fp8 (CUDA cores, then tensor cores).
    int4_packed = [(*c, False, form) for form in (1, 2) for c in INT4_PACKED_SWEEP]
    fp8_sweep = BYTE_SWEEP + [(*c, True) for c in FP8_DOT_SWEEP]
    out: list[tuple[str, Callable]] = []
    if method == "read_int4_rows":
        if m == 1:
            sweep = [(16, 128, 2, 4, 1, False, 0), (16, 256, 2, 4, 2, False, 0)]
            for c in and_splits_first(INT4_PACKED_SWEEP + READ_ROWS_LONG if not smoke else sweep):
                cfg = (*c[:5], len(c) > 7 and c[7])
                out.append((
                    f"read:{cfg_name((*c[:5], False, 0, cfg[5]))}",
                    lambda x, w, cfg=cfg: read_rows(w[3], w[4], GROUP, cfg),
                ))  # fmt: skip
    elif method in READ_METHODS:
        if m == 1:
            sms = 2 if smoke else torch.cuda.get_device_properties(0).multi_processor_count
            sweep = READ_SWEEP if not smoke else [(16, 1, 1), (32, 2, 2)]
            for block, warps, stages in sweep:
                for waves in READ_WAVES if not smoke else (0.5, 4):
                    programs = max(1, round(waves * sms))
                    out.append((
                        f"read:p{programs}_b{block}_w{warps}_s{stages}",
                        lambda x, w, c=(programs, block, warps, stages): read_words(w, *c),
                    ))  # fmt: skip
    elif method == "int4_ahead":
        if m == 1:
            smoke_sweep = [(16, 128, 2, 4, 1, False, 1), (16, 128, 2, 4, 1, False, 2)]
            for c in and_splits_first(int4_packed if not smoke else smoke_sweep):
                cfg = GemvConfig(*c)
                inputs = once_per_x(lambda x, form=cfg.packed: pack_int4_inputs(to16(x), form))

                def gemv_ahead(x, w, cfg=cfg, inputs=inputs):
                    x16, packed = to16(x), inputs(x)
                    return int4_gemv(x16, w[3], w[4], GROUP, config=cfg, packed_inputs=packed)

                out.append((f"ahead:{cfg_name(c)}", gemv_ahead))

            def pack_then_gemv(x, w):
                """The packing's own launch timed too, at the table's configuration (the CPU's
                default is not packed: its second form there)."""
                cfg = config_for("int4_ahead", w[3].shape[0], x.shape[1], x.device)
                if not cfg.packed and x.is_cuda:  # the runtime would not pack ahead either
                    raise ValueError(f"the table's one-row int4 form is not packed: {cfg}")
                cfg = cfg if cfg.packed else dataclasses.replace(cfg, packed=2)
                x16 = to16(x)
                ahead = pack_int4_inputs(x16, cfg.packed)
                return int4_gemv(x16, w[3], w[4], GROUP, config=cfg, packed_inputs=ahead)

            out.append(("pack+ahead:table", pack_then_gemv))
    elif method == "bf16":
        out.append(("F.linear", lambda x, w: F.linear(x, w)))
    elif method == "int4":
        if m == 1:
            sweep = INT4_SWEEP + and_splits_first(int4_packed)
            smoke_sweep = [(16, 128, 1, 4, 1), (16, 256, 2, 4, 2), (16, 128, 2, 4, 1, False, 1)]
            smoke_sweep.append((16, 128, 2, 4, 1, False, 2))
            for c in sweep if not smoke else and_splits_first(smoke_sweep):
                cfg = GemvConfig(*c)

                def gemv4(x, w, cfg=cfg):
                    return int4_gemv(x, w[3], w[4], GROUP, config=cfg)

                out.append((f"gemv:{cfg_name(c)}", gemv4))
        else:
            rc = 16 if m <= 16 else 128
            sweep = PLANAR_SWEEP[rc] if not smoke else [(16, 16, 4, 1)]
            for c in sweep:
                out.append(
                    (
                        "planar:bm{}_bn{}_w{}_s{}".format(*c),
                        lambda x, w, c=c: int4_planar_linear(x, w[3], w[4], GROUP, config=c),
                    )
                )

            def deq(x, w):
                return F.linear(x, dequantize_int4_planar(w[3], w[4], GROUP, x.shape[1], x.dtype))

            out.append(("dequant+cublas", deq))
        if m <= 16:  # the kernel this work replaces (autotunes on its first call per shape)
            out.append(("int4_linear(old)", lambda x, w: int4_linear(x, w[0], w[1], w[2], GROUP)))
    elif method == "int8":
        if m == 1:
            smoke_sweep = [(16, 64, 1, 4, 1), (16, 64, 2, 4, 2)]
            for c in and_splits_first(BYTE_SWEEP if not smoke else smoke_sweep):
                cfg = GemvConfig(*c)

                def gemv8(x, w, cfg=cfg):
                    return int8_gemv(x, w[0], w[1], config=cfg)

                out.append((f"gemv:{cfg_name(c)}", gemv8))
        out.append(("int8_linear", lambda x, w: int8_linear(x, w[0], w[1])))
    elif method == "fp8":
        if m == 1:
            smoke_sweep = [(16, 64, 1, 4, 1), (16, 64, 2, 4, 2), (16, 64, 2, 4, 2, True)]
            for c in and_splits_first(fp8_sweep if not smoke else smoke_sweep):
                cfg = GemvConfig(*c)

                def gemv_fp8(x, w, cfg=cfg):
                    return fp8_gemv(x, w[0], w[1], config=cfg)

                out.append((f"gemv:{cfg_name(c)}", gemv_fp8))
        if not smoke:
            for fast in (False, True):

                def scaled(x, w, fast=fast):
                    codes, xs = per_token_quant_fp8(x)
                    return torch._scaled_mm(
                        codes, w[0].t(), scale_a=xs, scale_b=w[1].reshape(1, -1),
                        out_dtype=torch.bfloat16, use_fast_accum=fast,
                    )  # fmt: skip

                out.append((f"quant+scaled_mm{'(fast_accum)' if fast else ''}", scaled))
    elif method == "fp8_ahead":
        if m == 1:
            smoke_sweep = [(16, 64, 2, 4, 2), (16, 64, 2, 4, 2, True)]
            for c in and_splits_first(fp8_sweep if not smoke else smoke_sweep):
                cfg = GemvConfig(*c)
                codes = once_per_x(per_token_quant_fp8)

                def fp8_ahead(x, w, cfg=cfg, codes=codes):
                    xq, xs = codes(x)
                    return fp8_gemv(x, w[0], w[1], config=cfg, x_codes=xq, x_scale=xs)

                out.append((f"ahead:{cfg_name(c)}", fp8_ahead))

            def quant_then_gemv(x, w):
                """The quantization's own launch timed too, at the table's configuration."""
                xq, xs = per_token_quant_fp8(x)
                cfg = config_for("fp8_ahead", w[0].shape[0], x.shape[1], x.device)
                return fp8_gemv(x, w[0], w[1], config=cfg, x_codes=xq, x_scale=xs)

            out.append(("quant+ahead:table", quant_then_gemv))
    return out


def reference(method: str, x: torch.Tensor, w) -> torch.Tensor:
    from braid.kernels.quant_reference import (
        fp8_linear_reference,
        int4_linear_reference,
        int8_linear_reference,
    )

    method = AHEAD.get(method, method)
    if method == "bf16":
        return x.float() @ w.float().T
    if method == "int4":
        return int4_linear_reference(x.float(), w[0], w[1], w[2], GROUP)
    if method == "int8":
        return int8_linear_reference(x.float(), w[0], w[1])
    return fp8_linear_reference(x, w[0], w[1], None, torch.float32)


def measure(args: argparse.Namespace, bench: Bench, copy_rate: float, rates: dict) -> list[dict]:
    from benchmarks.read_floor import xor_all

    dev = torch.device(args.device)
    gen = torch.Generator(device=dev).manual_seed(0)
    shapes, rows = (SMOKE["shapes"], SMOKE["rows"]) if args.smoke else (SHAPES, ROWS)
    if args.rows:
        rows = tuple(int(m) for m in args.rows.split(","))
    results = []
    for shape, (n, k) in shapes.items():
        copies = 2 if args.smoke else max(2, -(-COLD_BYTES // weight_bytes("int4", n, k)))
        copies = min(copies, args.calls)
        weights = make_weights(n, k, dev, copies, gen, args.methods.split(","))
        want_xor: dict[str, int] = {}
        for m in rows:
            dtype = torch.float32 if args.smoke else torch.bfloat16
            xs = [torch.randn(m, k, generator=gen, device=dev).to(dtype) for _ in range(2)]
            for method in args.methods.split(","):
                for name, call in variants(method, m, args.smoke):
                    ws = weights[WEIGHTS_OF.get(method, method)]
                    row = {
                        "shape": shape,
                        "n": n,
                        "k": k,
                        "m": m,
                        "method": method,
                        "variant": name,
                    }
                    try:
                        got = call(xs[0], ws[0])
                        if method in READ_METHODS:  # every word read: the same xor
                            if method not in want_xor:
                                words = ws[0][3:] if method == "read_int4_rows" else [ws[0]]
                                want_xor[method] = xor_all(torch.cat([w.ravel() for w in words]))
                            row["error"] = 0.0 if xor_all(got) == want_xor[method] else math.inf
                        else:
                            row["error"] = rel_error(got, reference(method, xs[0], ws[0]))
                        if method.startswith("fp8") and name.startswith(("gemv", "ahead")):
                            row["error"] = max(row["error"], _fp8_codes_check(xs[0]))
                        row["ok"] = row["error"] < MAX_ERROR
                        us = bench.per_call_us(
                            lambda i, call=call, ws=ws, xs=xs: call(xs[i % 2], ws[i % len(ws)]),
                            graph=m <= 128,
                        )
                    except (RuntimeError, ValueError) as e:  # recorded: a config that fails
                        row.update(ok=False, error=None, failure=f"{type(e).__name__}: {e}"[:300])
                        results.append(row)
                        continue
                    moved = weight_bytes(method, n, k) + 2 * m * (n + k)
                    row.update(us=us, bytes=moved, of_copy=moved / (us * 1e-6) / copy_rate)
                    flops = 2 * m * n * k
                    row["tflops"] = flops / (us * 1e-6) / 1e12
                    rate = rates["fp8" if method.startswith("fp8") else "bf16"]
                    row["mfu"] = flops / (us * 1e-6) / rate
                    results.append(row)
                    print(_fmt(row), flush=True)
        del weights
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return results


def _fp8_codes_check(x: torch.Tensor) -> float:
    """0 when per_token_quant_fp8 gives the reference's codes and scales bit for bit, else inf
    (the GEMV quantizes with the same code)."""
    from braid.kernels.fp8_quant import per_token_quant_fp8
    from braid.kernels.quant_reference import per_token_quant_fp8_reference

    codes, scales = per_token_quant_fp8(x)
    want_codes, want_scales = per_token_quant_fp8_reference(x)
    same = torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    return 0.0 if same and torch.equal(scales, want_scales) else float("inf")


def _fmt(r: dict) -> str:
    if r.get("us") is None:
        return f"{r['shape']:8s} M={r['m']:<5d} {r['method']:5s} {r['variant']:34s} FAILED"
    fig = f"mfu {r['mfu']:.3f}" if r["m"] >= 8192 else f"of_copy {r['of_copy']:.2f}"
    ok = "ok" if r["ok"] else f"WRONG err={r['error']:.2e}"
    return (
        f"{r['shape']:8s} M={r['m']:<5d} {r['method']:5s} {r['variant']:34s} "
        f"{r['us']:9.2f} us  {fig}  {ok}"
    )


def summarize(results: list[dict]) -> tuple[list[str], dict]:
    """The table (best correct variant per shape, M, method) and the runtime's tables."""
    best: dict[tuple, dict] = {}
    for r in results:
        if not r.get("ok") or r.get("us") is None:
            continue
        key = (r["shape"], r["m"], r["method"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    lines = []
    for (shape, m, method), r in sorted(best.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        base = best.get((shape, m, "bf16"))
        vs = f"{base['us'] / r['us']:5.2f}x bf16" if base else ""
        floor = best.get((shape, m, f"read_{method.removesuffix('_ahead')}"))
        vs += f"  {r['us'] / floor['us']:5.2f}x its read floor" if floor else ""
        lines.append(_fmt(r) + "  " + vs)
    # One of each shape (a decoder layer's four GEMVs), per method, where every shape ran.
    shapes = {r["shape"] for r in results}
    for method in sorted({key[2] for key in best if key[1] == 1}):
        got = [best.get((shape, 1, method)) for shape in sorted(shapes)]
        if all(got):
            us = sum(r["us"] for r in got)
            lines.append(f"a layer M=1 {method:9s} {us:9.2f} us (the best of each shape, summed)")
    tables: dict = {f"{kind.upper()}_CONFIGS": {} for kind in CONFIG_KINDS}
    for (_, m, method), r in best.items():
        form, _, variant = r["variant"].partition(":")
        if m == 1 and form in ("gemv", "ahead") and method != "bf16":
            parts = variant.split("_")
            nums = tuple(int("".join(ch for ch in part if ch.isdigit())) for part in parts[:5])
            packed = 2 if "f16x2z" in parts[5:] else int("f16x2" in parts[5:])
            nums += ("dot" in parts[5:], packed, "sf" in parts[5:])
            tables[f"{method.upper()}_CONFIGS"][(r["n"], r["k"])] = nums
    # The smallest M at which dequant+cublas beats the planar kernel on every shape.
    crossover = None
    for m in sorted({r["m"] for r in results if r["m"] > 1}):
        rows = [r for r in results if r["m"] == m and r["method"] == "int4" and r.get("ok")]
        deq = {r["shape"]: r["us"] for r in rows if r["variant"] == "dequant+cublas"}
        planar: dict[str, float] = {}
        for r in rows:
            if r["variant"].startswith("planar"):
                planar[r["shape"]] = min(planar.get(r["shape"], float("inf")), r["us"])
        if deq and all(deq[s] <= planar.get(s, float("inf")) for s in deq):
            crossover = m
            break
    tables["DEQUANTIZE_MIN_ROWS"] = crossover
    return lines, tables


def write_config(tables: dict, device_name: str, path: Path) -> None:
    """Merge the one-row choices of `summarize`'s tables into `path` (quant_gemv.json) under
    `device_name`: {"kind/N/K": [block_n, block_k, split_k, warps, stages, dot, packed,
    splits_first]}."""
    import json
    from dataclasses import astuple

    from braid.kernels.quant_gemv import table_config, tuned_key

    data = json.loads(path.read_text()) if path.is_file() else {}
    entry = data.setdefault(device_name, {})
    for kind in CONFIG_KINDS:
        for (n, k), c in tables[f"{kind.upper()}_CONFIGS"].items():
            entry[tuned_key(kind, n, k)] = list(astuple(table_config(c)))
    data[device_name] = dict(sorted(entry.items()))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {len(entry)} configurations for {device_name} to {path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="toy shapes on the CPU (interpreter)")
    methods = ("bf16", "int4", "int8", "fp8", *AHEAD, *READ_METHODS)
    ap.add_argument("--methods", default=",".join(methods))
    ap.add_argument("--calls", type=int, default=32, help="calls per timed graph replay")
    ap.add_argument("--repeats", type=int, default=7, help="timed replays (median)")
    ap.add_argument("--out", default=None, help="JSON path")
    ap.add_argument(
        "--rows", default=None, help="comma-separated row counts (default 1,16,128,8192)"
    )
    ap.add_argument(
        "--write-config",
        action="store_true",
        help="record the fastest correct one-row configuration per method and shape for this "
        "GPU in braid/kernels/configs/quant_gemv.json",
    )
    args = ap.parse_args(argv)
    args.device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        # One timed call a variant: the interpreter's time says nothing, and each call is a
        # second of its run.
        args.calls, args.repeats = 1, 1
        args.methods = ",".join(m for m in args.methods.split(",") if m != "bf16") or "int4"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        sys.exit("benchmarks/quant_kernels.py needs a CUDA GPU; --smoke checks the script on CPU")
    from benchmarks.common import copy_bandwidth, matmul_rate, write_result
    from benchmarks.quantization import fp8_matmul_rate

    t0 = time.perf_counter()
    dev = torch.device(args.device)
    if args.smoke:
        copy = {"bytes_per_s": 1e10}
        rates = {"bf16": 1e12, "fp8": 2e12}
    else:
        copy = copy_bandwidth(args.device)
        rates = {
            "bf16": matmul_rate(args.device, 8192, torch.bfloat16, 5)["flops_per_s"],
            "fp8": fp8_matmul_rate(args.device, 8192, repeats=5)["flops_per_s"],
        }
    print(f"copy rate {copy['bytes_per_s'] / 1e12:.2f} TB/s, bf16 {rates['bf16'] / 1e12:.0f} "
          f"TFLOP/s, fp8 {rates['fp8'] / 1e12:.0f} TFLOP/s", flush=True)  # fmt: skip
    results = measure(args, Bench(dev, args.calls, args.repeats), copy["bytes_per_s"], rates)
    lines, tables = summarize(results)
    failed = [r for r in results if not r.get("ok")]
    bad = [(r["shape"], r["m"], r["variant"]) for r in failed]
    took = time.perf_counter() - t0
    print(f"\n{len(results)} variants measured in {took:.0f} s; {len(bad)} wrong or failed: {bad}")
    print("\n".join(lines))
    for name in (f"{kind.upper()}_CONFIGS" for kind in CONFIG_KINDS):
        body = ", ".join(f"{nk}: GemvConfig{c}" for nk, c in sorted(tables[name].items()))
        print(f"{name} = {{{body}}}")
    print(f"DEQUANTIZE_MIN_ROWS = {tables['DEQUANTIZE_MIN_ROWS']}")
    if args.write_config and not args.smoke:
        from braid.kernels.quant_gemv import TUNED_CONFIGS

        write_config(tables, torch.cuda.get_device_name(dev), TUNED_CONFIGS)
    write_result(
        "quant_kernels",
        args.device,
        args.out,
        {
            "smoke": args.smoke,
            "copy_bandwidth": copy,
            "matmul_rates": rates,
            "rows": results,
            "best": lines,
            "tables": {
                name: {str(nk): c for nk, c in v.items()} if isinstance(v, dict) else v
                for name, v in tables.items()
            },
        },
        script="benchmarks/quant_kernels.py",
    )


if __name__ == "__main__":
    main()
