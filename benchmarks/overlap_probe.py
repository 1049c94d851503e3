"""Would two micro-batches on two CUDA streams bring offline decode near its bound? A probe at
Llama-3.1-8B's layer shapes, outside the runtime: the decode step's memory-bound attention and
compute-bound projections, one after the other and side by side.

    python benchmarks/overlap_probe.py                       # batch 1024, 640-token context
    python benchmarks/overlap_probe.py --smoke               # toy shapes on the CPU

Issue 21's offline figure (1024 x (512 in, 256 out) at 0.60 of the bound) is held down, in
decode, by attention that reads the KV cache (memory-bound) and the layer's GEMMs (compute-
bound) running one after the other, where the bound takes the larger of the two. Splitting the
batch into two halves, each on its own stream, lets one half's attention run while the other
half's GEMMs do (SGLang's two-batch overlap, NanoFlow's nano-batches). This measures how much
of that overlap one GPU gives with braid's own kernels, before the runtime is changed for it.

`--layers` decoder layers (each its own weights and KV, so reads are cold), each: the qkv
projection, braid's decode attention (`decode_attention`, the runtime's split count) over
`--context` tokens per request, the o projection, gate_up, `silu_and_mul`, down; residual adds
and norms are left out (small against these). Timed as CUDA graphs (median of `--repeats`):
- `attention_ms`, `gemms_ms`: the attention alone, the rest alone, at the full batch;
- `serial_ms`: the whole layers at the full batch on one stream (what braid runs today);
- `halves_serial_ms`: two half-batches one after the other on one stream;
- `two_streams_ms`: the two halves on two streams, each half's layers in order;
- `carveout_ms`: the same with cuBLAS told to leave N SMs free (`--carveouts`, torch's
  `_set_sm_carveout_experimental`, which only cuBLASLt takes: the GEMMs go through it there;
  `cublaslt_two_streams_ms` is cuBLASLt without a carveout, its baseline), so the other
  stream's attention has SMs to run on while a GEMM runs (a kernel that fills every SM leaves
  none: the streams then only alternate);
- `bound_ms`: max(attention, gemms) (the offline bound's model of a step), and the fraction
  of the serial time the two streams save, against the most overlap could save
  (min(attention, gemms)).
Writes benchmarks/results/overlap_probe_<device>.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_result  # noqa: E402

# Llama-3.1-8B: hidden, heads, KV heads, head dim, intermediate.
SHAPE = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, inter=14336)
SMOKE_SHAPE = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, inter=96)


class Layer:
    """One decoder layer's weights and KV cache for `batch` requests of `context` tokens."""

    def __init__(self, s: dict, batch: int, context: int, dtype, device, gen) -> None:
        def w(n: int, k: int) -> torch.Tensor:
            return (torch.randn(n, k, generator=gen, device=device) * 0.02).to(dtype)

        q_out = s["heads"] * s["head_dim"]
        kv_out = s["kv_heads"] * s["head_dim"]
        self.s = s
        self.qkv = w(q_out + 2 * kv_out, s["hidden"])
        self.o = w(s["hidden"], q_out)
        self.gate_up = w(2 * s["inter"], s["hidden"])
        self.down = w(s["hidden"], s["inter"])
        slots = batch * context
        shape = (slots, s["kv_heads"], s["head_dim"])
        self.k = torch.randn(shape, generator=gen, device=device).to(dtype)
        self.v = torch.randn(shape, generator=gen, device=device).to(dtype)


class Batch:
    """One micro-batch: its rows of the hidden state and its requests' token tables."""

    def __init__(self, s: dict, rows: range, context: int, dtype, device, gen) -> None:
        n = len(rows)
        self.x = torch.randn(n, s["hidden"], generator=gen).to(device, dtype)
        width = (s["heads"] + 2 * s["kv_heads"]) * s["head_dim"]
        self.qkv = torch.randn(n, width, generator=gen).to(device, dtype)
        # Request r's tokens are the slots r * context ... r * context + context - 1, shuffled
        # within the request (a long-running pool's pages are not in order).
        order = torch.stack([torch.randperm(context, generator=gen) for _ in rows]).to(device)
        base = torch.tensor(list(rows), device=device)[:, None] * context
        self.table = (base + order).to(torch.int32)
        self.pool = torch.arange(n, dtype=torch.int32, device=device)
        self.lens = torch.full((n,), context, dtype=torch.int32, device=device)
        from braid.kernels.attention_decode import workspace_numel
        from braid.runtime.attention.triton_backend import kv_splits_for_batch

        self.splits = kv_splits_for_batch(n, s["kv_heads"]) if device.type == "cuda" else 2
        numel = workspace_numel(n, s["heads"], s["head_dim"], self.splits)
        self.workspace = torch.empty(numel, dtype=torch.float32, device=device)


def attention(layer: Layer, b: Batch, qkv: torch.Tensor) -> torch.Tensor:
    from braid.kernels.attention_decode import decode_attention

    s = layer.s
    q = qkv[:, : s["heads"] * s["head_dim"]].view(-1, s["heads"], s["head_dim"])
    out = decode_attention(
        q, layer.k, layer.v, b.table, b.pool, b.lens, s["head_dim"] ** -0.5,
        num_kv_splits=b.splits, workspace=b.workspace,
    )  # fmt: skip
    return out.view(q.shape[0], -1)


def forward(layers: list[Layer], b: Batch, parts: str = "all") -> torch.Tensor:
    """The layers over micro-batch `b`: "all", or "attention" / "gemms" alone (attention alone
    reads a fixed qkv; the GEMMs alone take q's columns for attention's output)."""
    from braid.kernels.activation import silu_and_mul

    h = b.x
    for layer in layers:
        if parts == "attention":
            h = attention(layer, b, b.qkv)
            continue
        qkv = F.linear(h, layer.qkv)
        a = attention(layer, b, qkv) if parts == "all" else qkv[:, : h.shape[1]]
        h = F.linear(silu_and_mul(F.linear(F.linear(a, layer.o), layer.gate_up)), layer.down)
    return h


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median ms of `fn` replayed as a CUDA graph (on the CPU: the wall time of one call)."""
    from benchmarks.quant_kernels import Bench

    return Bench(device, 1, repeats).per_call_us(lambda i: fn(), graph=True) / 1e3


def two_streams(
    layers: list[Layer], a: Batch, b: Batch, device: torch.device, carveout: int = 0
) -> Callable:
    """Both halves' layers, each half on its own stream (forked from and joined to the current
    one, so the pair captures into one graph), cuBLAS leaving `carveout` SMs free (only
    cuBLASLt honours it: wrap the result in `lt`); on the CPU, one after the other."""
    if device.type != "cuda":
        return lambda: (forward(layers, a), forward(layers, b))
    side = [torch.cuda.Stream(device), torch.cuda.Stream(device)]

    def run() -> None:
        main = torch.cuda.current_stream(device)
        torch._C._set_sm_carveout_experimental(carveout or None)
        try:
            for stream, half in zip(side, (a, b)):
                stream.wait_stream(main)
                with torch.cuda.stream(stream):
                    forward(layers, half)
        finally:
            torch._C._set_sm_carveout_experimental(None)
        for stream in side:
            main.wait_stream(stream)

    return run


def lt(fn: Callable[[], object]) -> Callable[[], None]:
    """`fn` with torch's GEMMs on cuBLASLt (on a GPU)."""

    def run() -> None:
        if not torch.cuda.is_available():
            fn()
            return
        library = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            fn()
        finally:
            torch.backends.cuda.preferred_blas_library(library)

    return run


def probe(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    s = SMOKE_SHAPE if args.smoke else SHAPE
    dtype = torch.float32 if args.smoke else torch.bfloat16
    gen = torch.Generator(device="cpu").manual_seed(0)
    dev_gen = torch.Generator(device=device).manual_seed(0)
    batch, context = args.batch, args.context
    layers = [Layer(s, batch, context, dtype, device, dev_gen) for _ in range(args.layers)]
    full = Batch(s, range(batch), context, dtype, device, gen)
    half = batch // 2
    a = Batch(s, range(half), context, dtype, device, gen)
    b = Batch(s, range(half, batch), context, dtype, device, gen)
    # The halves compute the full batch's rows (same requests, same KV).
    a.x.copy_(full.x[:half])
    b.x.copy_(full.x[half:])
    want = forward(layers, full)
    got_a, got_b = forward(layers, a), forward(layers, b)
    error = float((torch.cat([got_a, got_b]) - want).float().norm() / want.float().norm())
    r = args.repeats
    res = {
        "attention_ms": timed(lambda: forward(layers, full, "attention"), device, r),
        "gemms_ms": timed(lambda: forward(layers, full, "gemms"), device, r),
        "serial_ms": timed(lambda: forward(layers, full), device, r),
        "halves_serial_ms": timed(lambda: (forward(layers, a), forward(layers, b)), device, r),
        "two_streams_ms": timed(two_streams(layers, a, b, device), device, r),
        "halves_error": error,
        "cublaslt_two_streams_ms": timed(lt(two_streams(layers, a, b, device)), device, r),
        "carveout_ms": {
            str(c): timed(lt(two_streams(layers, a, b, device, c)), device, r)
            for c in args.carveouts
        },
    }
    res["bound_ms"] = max(res["attention_ms"], res["gemms_ms"])
    most = min(res["attention_ms"], res["gemms_ms"])
    res["saved_of_possible"] = (res["serial_ms"] - res["two_streams_ms"]) / most
    res["serial_over_bound"] = res["bound_ms"] / res["serial_ms"]
    res["two_streams_over_bound"] = res["bound_ms"] / res["two_streams_ms"]
    return res


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="toy shapes on the CPU (interpreter)")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--context", type=int, default=640, help="KV tokens per request")
    ap.add_argument("--layers", type=int, default=4, help="layers per timed graph")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument(
        "--carveouts", default="16,32,48,66", help="SMs cuBLAS leaves free, comma-separated"
    )
    ap.add_argument("--out", default=None, help="JSON path")
    args = ap.parse_args(argv)
    args.carveouts = [int(c) for c in args.carveouts.split(",") if c]
    args.device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.batch, args.context, args.layers, args.repeats = 8, 24, 2, 1
    if args.batch < 2 or args.batch % 2:
        ap.error(f"--batch must be even and at least 2, got {args.batch}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    elif not torch.cuda.is_available():
        sys.exit("benchmarks/overlap_probe.py needs a CUDA GPU; --smoke checks it on the CPU")
    res = probe(args)
    print(
        f"batch {args.batch}, context {args.context}, {args.layers} layers: attention "
        f"{res['attention_ms']:.3f} ms, gemms {res['gemms_ms']:.3f} ms, bound (the larger) "
        f"{res['bound_ms']:.3f}\n  one stream {res['serial_ms']:.3f} ms "
        f"({res['serial_over_bound']:.2f} of the bound), halves one after the other "
        f"{res['halves_serial_ms']:.3f}, halves on two streams {res['two_streams_ms']:.3f} "
        f"({res['two_streams_over_bound']:.2f} of the bound; saved "
        f"{res['saved_of_possible']:.0%} of what overlap could save)\n  with SMs left free by "
        f"cuBLAS(Lt): {res['carveout_ms']} ms (cuBLASLt without: "
        f"{res['cublaslt_two_streams_ms']:.3f})\n  halves against the "
        f"full batch: relative error {res['halves_error']:.1e}",
        flush=True,
    )
    write_result(
        "overlap_probe",
        args.device,
        args.out,
        {"smoke": args.smoke, "batch": args.batch, "context": args.context,
         "layers": args.layers, "shape": SMOKE_SHAPE if args.smoke else SHAPE, **res},
    )  # fmt: skip


if __name__ == "__main__":
    main()
