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
- `lanes`: the halves as a pipeline of two lanes, every attention on one stream and every
  GEMM on another (`lanes()`), so one half's attention runs beside the other half's GEMMs by
  construction, on two plain streams (each kernel still takes every SM it finds); `at_once`:
  the full batch's attention and GEMMs on those streams with nothing ordering them (the most
  any overlap could give);
- `green`, keyed by the attention lane's SMs (`--green-sms`): the same on two green contexts
  that split the SMs between the lanes (CUDA 12.4+ driver, `green_streams`), a partition the
  hardware enforces, which two plain streams and cuBLAS's carveout could not give: the lanes,
  `cublaslt_sized` (the GEMMs on cuBLASLt told their share), `attention_alone` and
  `gemms_alone` (each lane's work alone on its SMs) and `at_once`;
- `evict_first`: attention, one stream, the lanes and `at_once` (plain and green) again with
  the attention's K/V loads marked evict-first in L2 (`decode_attention(kv_evict_first=)`).
Each of these is timed as a CUDA graph where its streams capture (`graph_ms`, else None and
`graph_error`) and eagerly (`eager_ms`, beside `serial_eager_ms`);
- `bound_ms`: max(attention, gemms) (the offline bound's model of a step), and the fraction
  of the serial time the two streams save, against the most overlap could save
  (min(attention, gemms)).
Writes benchmarks/results/overlap_probe_<device>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
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


_EVICT_FIRST = [False]  # attention's K/V loads evict-first (`streaming_kv`)


@contextlib.contextmanager
def streaming_kv():
    """Within: the attention's key and value loads are marked evict-first in L2."""
    _EVICT_FIRST[0] = True
    try:
        yield
    finally:
        _EVICT_FIRST[0] = False


def attention(layer: Layer, b: Batch, qkv: torch.Tensor) -> torch.Tensor:
    from braid.kernels.attention_decode import decode_attention

    s = layer.s
    q = qkv[:, : s["heads"] * s["head_dim"]].view(-1, s["heads"], s["head_dim"])
    out = decode_attention(
        q, layer.k, layer.v, b.table, b.pool, b.lens, s["head_dim"] ** -0.5,
        num_kv_splits=b.splits, workspace=b.workspace, kv_evict_first=_EVICT_FIRST[0],
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


def side_by_side(*pairs: tuple[object, Callable[[], object]]) -> Callable[[], None]:
    """Each (stream, fn) of `pairs`: fn on its stream, all forked from the current stream
    before any runs and joined to it after (so they capture into one graph), with nothing
    ordering one after another."""

    def run() -> None:
        main = torch.cuda.current_stream()
        for stream, _ in pairs:
            stream.wait_stream(main)
        for stream, fn in pairs:
            with torch.cuda.stream(stream):
                fn()
        for stream, _ in pairs:
            main.wait_stream(stream)

    return run


def two_streams(layers: list[Layer], a: Batch, b: Batch, device: torch.device) -> Callable:
    """Both halves' layers, each half on its own stream (`side_by_side`); on the CPU, one after
    the other."""
    if device.type != "cuda":
        return lambda: (forward(layers, a), forward(layers, b))
    side = [torch.cuda.Stream(device), torch.cuda.Stream(device)]
    return side_by_side(
        (side[0], lambda: forward(layers, a)), (side[1], lambda: forward(layers, b))
    )


def lanes(layers: list[Layer], halves: tuple[Batch, Batch], streams: tuple | None) -> Callable:
    """Both halves' layers as two lanes: every attention on `streams[0]`, every GEMM (and
    `silu_and_mul`) on `streams[1]`, ordered by events so that half A's attention of layer l
    runs while half B's GEMMs of layer l - 1 (and the qkv of l) do, then B's attention beside
    A's GEMMs. Each lane runs one kernel at a time; the lanes' streams are forked from and
    joined to the current one (the pair captures into one graph where the streams allow). With
    `streams` None (the CPU) the same kernels run in the same order on one stream, without
    the events (the CPU checks the data flow, the GPU runs the events). The tensors a lane
    hands the other live until the join (no block is reused while the other lane may read
    it)."""
    from braid.kernels.activation import silu_and_mul

    def on(stream):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def run() -> torch.Tensor:
        attn_s, gemm_s = streams if streams is not None else (None, None)
        keep: list[torch.Tensor] = []
        if streams is not None:
            main = torch.cuda.current_stream()
            attn_s.wait_stream(main)
            gemm_s.wait_stream(main)
        ready: dict[int, object] = {}  # half -> the event after its last GEMM or attention

        def handoff(i: int, stream) -> None:
            if stream is not None:
                event = torch.cuda.Event()
                event.record(stream)
                ready[i] = event

        def wait(i: int, stream) -> None:
            if stream is not None:
                stream.wait_event(ready[i])

        qkv = {}
        with on(gemm_s):
            for i, half in enumerate(halves):
                qkv[i] = F.linear(half.x, layers[0].qkv)
                keep.append(qkv[i])
                handoff(i, gemm_s)
        outs = {}
        for n, layer in enumerate(layers):
            for i, half in enumerate(halves):
                with on(attn_s):
                    wait(i, attn_s)
                    a = attention(layer, half, qkv[i])
                    keep.append(a)
                    handoff(i, attn_s)
                with on(gemm_s):
                    wait(i, gemm_s)
                    h = F.linear(silu_and_mul(F.linear(F.linear(a, layer.o), layer.gate_up)),
                                 layer.down)  # fmt: skip
                    keep.append(h)
                    if n + 1 < len(layers):
                        qkv[i] = F.linear(h, layers[n + 1].qkv)
                        keep.append(qkv[i])
                    handoff(i, gemm_s)
                outs[i] = h
        if streams is not None:
            main.wait_stream(attn_s)
            main.wait_stream(gemm_s)
        return torch.cat([outs[0], outs[1]])

    return run


# CUdevResource (cuda.h, CUDA 12.4-13): its type (4 bytes), 92 bytes of padding, then the SM
# resource whose first field is smCount; under 160 bytes in every header so far, so a buffer
# of 512 holds any of them.
_RESOURCE_BYTES = 512
_SM_COUNT_OFFSET = 96


def green_streams(device: torch.device, sms: int) -> tuple[object, object, int, int]:
    """Two streams whose kernels run on disjoint SMs of `device`: green contexts (CUDA driver
    12.4+, through libcuda directly), the first on `sms` SMs (the driver rounds up to its
    granularity), the second on the rest. Returns the streams and their SM counts."""
    lib = ctypes.CDLL("libcuda.so.1")
    torch.cuda.current_stream(device).synchronize()  # the primary context is current

    def check(rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            lib.cuGetErrorName(rc, ctypes.byref(name))
            raise RuntimeError(f"{what}: {(name.value or b'?').decode()} ({rc})")

    lib.cuGreenCtxCreate.argtypes = [
        ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_int, ctypes.c_uint,
    ]  # fmt: skip
    lib.cuGreenCtxStreamCreate.argtypes = [
        ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_uint, ctypes.c_int,
    ]  # fmt: skip
    dev = ctypes.c_int()
    check(lib.cuDeviceGet(ctypes.byref(dev), device.index or 0), "cuDeviceGet")
    whole = ctypes.create_string_buffer(_RESOURCE_BYTES)
    check(lib.cuDeviceGetDevResource(dev, whole, 1), "cuDeviceGetDevResource (SM)")
    part = ctypes.create_string_buffer(_RESOURCE_BYTES)
    rest = ctypes.create_string_buffer(_RESOURCE_BYTES)
    groups = ctypes.c_uint(1)
    check(
        lib.cuDevSmResourceSplitByCount(part, ctypes.byref(groups), whole, rest, 0, sms),
        f"cuDevSmResourceSplitByCount({sms})",
    )
    streams = []
    for resource in (part, rest):
        desc, ctx, stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        check(lib.cuDevResourceGenerateDesc(ctypes.byref(desc), resource, 1), "GenerateDesc")
        check(lib.cuGreenCtxCreate(ctypes.byref(ctx), desc, dev, 1), "cuGreenCtxCreate")
        # CU_STREAM_NON_BLOCKING, as the driver requires of a green context's streams.
        check(lib.cuGreenCtxStreamCreate(ctypes.byref(stream), ctx, 1, 0), "StreamCreate")
        streams.append(torch.cuda.ExternalStream(stream.value, device=device))

    def count(resource: ctypes.Array) -> int:
        return ctypes.c_uint.from_buffer(resource, _SM_COUNT_OFFSET).value

    return streams[0], streams[1], count(part), count(rest)


def eager(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median ms of `fn` launched from Python, 4 calls a repeat (on the CPU: one call's wall)."""
    from benchmarks.quant_kernels import Bench

    calls = 4 if device.type == "cuda" else 1  # the CPU (the interpreter) times nothing real
    return Bench(device, calls, repeats).per_call_us(lambda i: fn(), False) / 1e3


def timed_both(fn: Callable[[], object], device: torch.device, repeats: int) -> dict:
    """`fn`'s median ms as a CUDA graph (None, with the reason, where its streams do not
    capture) and eagerly."""
    res: dict = {"eager_ms": eager(fn, device, repeats)}
    try:
        res["graph_ms"] = timed(fn, device, repeats)
    except Exception as e:  # noqa: BLE001 (a capture refused: reported, the eager time stands)
        res["graph_ms"], res["graph_error"] = None, f"{type(e).__name__}: {e}"[:300]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return res


def at_once(layers: list[Layer], b: Batch, attn_s, gemm_s) -> Callable[[], None]:
    """The attention alone on `attn_s` and the GEMMs alone on `gemm_s`, with nothing ordering
    one after the other: how long both take when each has only the other to contend with
    (their SMs, if the streams' contexts split them, and the memory they share)."""
    return side_by_side(
        (attn_s, lambda: forward(layers, b, "attention")),
        (gemm_s, lambda: forward(layers, b, "gemms")),
    )


def carved(fn: Callable[[], object], carveout: int) -> Callable[[], None]:
    """`fn` with cuBLAS(Lt) told to leave `carveout` SMs free (only cuBLASLt takes it)."""

    def run() -> None:
        torch._C._set_sm_carveout_experimental(carveout or None)
        try:
            fn()
        finally:
            torch._C._set_sm_carveout_experimental(None)

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
            str(c): timed(lt(carved(two_streams(layers, a, b, device), c)), device, r)
            for c in args.carveouts
        },
    }
    want_cat = torch.cat([got_a, got_b])
    cuda = device.type == "cuda"
    plain = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if cuda else None
    run = lanes(layers, (a, b), plain)
    res["lanes_error"] = float((run() - want_cat).float().norm() / want_cat.float().norm())
    res["lanes"] = timed_both(run, device, r)
    if cuda:
        res["at_once"] = timed_both(at_once(layers, full, *plain), device, r)
    res["serial_eager_ms"] = eager(lambda: forward(layers, full), device, r)
    res["green"] = {}
    greens = {}
    for sms in args.green_sms if cuda else []:
        try:
            attn_s, gemm_s, n_attn, n_gemm = green_streams(device, sms)
        except Exception as e:  # noqa: BLE001 (no green contexts here: said, not hidden)
            res["green"][str(sms)] = {"error": f"{type(e).__name__}: {e}"[:300]}
            continue
        greens[str(sms)] = (attn_s, gemm_s)
        run = lanes(layers, (a, b), (attn_s, gemm_s))
        err = float((run() - want_cat).float().norm() / want_cat.float().norm())
        res["green"][str(sms)] = {
            "attention_sms": n_attn, "gemm_sms": n_gemm, "error": err,
            **timed_both(run, device, r),
            # cuBLAS sizes its grids for the whole GPU; cuBLASLt told the GEMM lane's share.
            "cublaslt_sized": timed_both(lt(carved(run, n_attn)), device, r),
            # Each lane's work alone on its SMs, at the full batch.
            "attention_alone": timed_both(
                side_by_side((attn_s, lambda: forward(layers, full, "attention"))), device, r
            ),
            "gemms_alone": timed_both(
                side_by_side((gemm_s, lambda: forward(layers, full, "gemms"))), device, r
            ),
            "at_once": timed_both(at_once(layers, full, attn_s, gemm_s), device, r),
        }  # fmt: skip
    # Again with attention's K/V loads evict-first in L2, so that streaming the KV cache does
    # not push out the tiles the GEMMs beside it reuse.
    with streaming_kv():
        ev = {
            "attention_ms": timed(lambda: forward(layers, full, "attention"), device, r),
            "serial_ms": timed(lambda: forward(layers, full), device, r),
            "lanes": timed_both(lanes(layers, (a, b), plain), device, r),
            "green": {
                sms: {
                    "lanes": timed_both(lanes(layers, (a, b), pair), device, r),
                    "at_once": timed_both(at_once(layers, full, *pair), device, r),
                }
                for sms, pair in greens.items()
            },
        }  # fmt: skip
        if cuda:
            ev["at_once"] = timed_both(at_once(layers, full, *plain), device, r)
    res["evict_first"] = ev
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
    ap.add_argument(
        "--green-sms", default="32,48,64,80",
        help="SMs of the attention lane's green context (the GEMM lane gets the rest)",
    )  # fmt: skip
    ap.add_argument("--out", default=None, help="JSON path")
    args = ap.parse_args(argv)
    args.carveouts = [int(c) for c in args.carveouts.split(",") if c]
    args.green_sms = [int(c) for c in args.green_sms.split(",") if c]
    args.device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.batch, args.context, args.layers, args.repeats = 4, 24, 2, 1
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
    bound = res["bound_ms"]

    def lane_line(name: str, t: dict) -> str:
        graph = t.get("graph_ms")
        g = f"{graph:.3f} ms as a graph ({bound / graph:.2f} of the bound)" if graph else (
            f"no graph ({t.get('graph_error', '')[:80]})"
        )  # fmt: skip
        return f"  {name}: {g}, {t['eager_ms']:.3f} ms eager ({bound / t['eager_ms']:.2f})"

    print(f"  one stream eager {res['serial_eager_ms']:.3f} ms "
          f"({bound / res['serial_eager_ms']:.2f} of the bound)")  # fmt: skip
    plain = lane_line("lanes on two plain streams", res["lanes"])
    print(f"{plain}, error {res['lanes_error']:.1e}")
    if "at_once" in res:
        print(lane_line("  attention and GEMMs at once on two plain streams", res["at_once"]))
    for sms, t in res["green"].items():
        if "eager_ms" not in t:
            print(f"  green contexts, {sms} SMs for attention: {t['error']}")
            continue
        print(lane_line(f"lanes on green contexts, attention {t['attention_sms']} SMs / GEMMs "
                        f"{t['gemm_sms']}", t) + f", error {t['error']:.1e}")  # fmt: skip
        print(lane_line("    the same, GEMMs on cuBLASLt sized to their SMs", t["cublaslt_sized"]))
        print(lane_line("    attention alone on its SMs", t["attention_alone"]))
        print(lane_line("    GEMMs alone on theirs", t["gemms_alone"]))
        print(lane_line("    both alone at once, nothing ordering them", t["at_once"]))
    ev = res["evict_first"]
    print(f"  with the K/V loads evict-first: attention {ev['attention_ms']:.3f} ms, one stream "
          f"{ev['serial_ms']:.3f} ({bound / ev['serial_ms']:.2f} of the bound)")  # fmt: skip
    print(lane_line("    lanes on two plain streams", ev["lanes"]))
    if "at_once" in ev:
        print(lane_line("    attention and GEMMs at once on two plain streams", ev["at_once"]))
    for sms, t in ev["green"].items():
        print(lane_line(f"    lanes on green contexts ({sms} SMs for attention)", t["lanes"]))
        print(lane_line("      both alone at once", t["at_once"]))
    write_result(
        "overlap_probe",
        args.device,
        args.out,
        {"smoke": args.smoke, "batch": args.batch, "context": args.context,
         "layers": args.layers, "shape": SMOKE_SHAPE if args.smoke else SHAPE, **res},
    )  # fmt: skip


if __name__ == "__main__":
    main()
