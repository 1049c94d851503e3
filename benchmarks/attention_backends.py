"""Attention backends side by side: braid's Triton kernels against FlashInfer, one layer at
Llama-3.1-8B shapes (32 query heads, 8 KV heads, head dim 128) in bfloat16, through braid's
backend classes (plan + KV store + attention, as a forward runs them), and what FlashInfer's
JIT compilation costs a fresh GPU machine.

    python benchmarks/attention_backends.py jit     # build FlashInfer's kernels for the
                                                    # variants braid runs, in parallel, timed
    python benchmarks/attention_backends.py bench   # decode at a 4k context (batch 1, 32, 256)
                                                    # and extends, both backends
    python benchmarks/attention_backends.py bench --smoke   # tiny shapes on CPU: Triton
                                                    # interpreted, FlashInfer absent; a check

`jit` starts one process per variant (dtype, head dim, heads, KV heads, window: the Llama-8B
shape, the tests' shapes, the tiny fidelity model), all at once, each running a decode and an
extend through `FlashInferBackend` so that every module the variant needs is compiled; it
reports each process's seconds, the wall time of the whole build (what a fresh machine pays
before FlashInfer's first forward), the size of the compiled cache (whether carrying it would
fit the 64 MiB a call carries), installs the built modules as FlashInfer AOT modules
(`install_aot`: later processes load them without ninja; `--aot-out DIR` keeps a copy to carry
to a fresh machine, where `cp -r DIR/* $(python -c "import flashinfer.jit.env as e;
print(e.FLASHINFER_AOT_DIR)")` replaces the build), then a second pass that loads them
(`--cached-limit` seconds per process).

`bench` times, per case and backend: `init_forward_metadata` on the host (the per-forward plan,
paid once per step for all layers), one layer's `forward` eagerly (CUDA events, median of
`--repeats` x `--per-repeat` back-to-back calls), and for decode the same forward replayed from a
CUDA graph through the backend's graph hooks; first, each backend's output is compared with
`torch_native`'s on the same pool (`max_abs_err`). Decode is memory-bound: its bound is the KV bytes
read / the measured copy rate; extend reports its FLOP rate against the measured bf16 matmul
rate. FlashInfer runs at page sizes 1 (braid's default) and 16. Requests' pages are shuffled
through the pool, as after churn. Writes benchmarks/results/attention_backends_cuda.json
(`jit` writes flashinfer_jit_cuda.json).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernel_timings import Timer  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DECODE = [(1, 4096), (32, 4096), (256, 4096)]  # (batch, context)
EXTEND = [(16, 0, 512), (1, 0, 4096), (8, 1024, 512)]  # (batch, cached prefix, new tokens)
# (dtype, head dim, heads, KV heads, window): what the GPU tests and benchmarks run.
JIT_VARIANTS = [
    ("bfloat16", 128, 32, 8, None),  # Llama-3.1-8B: FA3 prefill, tensor-core decode
    ("float16", 64, 8, 8, None),  # MHA: the CUDA-core decode kernel (the tests' second shape)
    ("bfloat16", 256, 16, 8, 1024),  # head dim 256 with a sliding window
    ("bfloat16", 128, 32, 8, 1000),  # Mistral-like: head dim 128 with a sliding window
    ("float16", 64, 4, 2, None),  # the tiny fidelity model (tests: TINY with head dim 64)
]


@dataclass
class Case:
    backend: str  # "triton" or "flashinfer"
    page_size: int
    mode: str  # "decode" or "extend"
    batch: int
    prefix: int
    new: int
    plan_us: float | None = None
    eager_us: float | None = None
    graph_us: float | None = None
    bytes: int | None = None
    flops: int | None = None
    of_bound: float | None = None
    max_abs_err: float | None = None  # against torch_native on the same pool and inputs
    error: str | None = None


def build(batch, prefix, new, page_size, dtype, device, heads=HEADS, kvh=KV_HEADS, d=HEAD_DIM):
    """A one-layer pool of `batch` requests with `prefix` cached tokens and `new` to come, each
    on its own shuffled pages; the ForwardBatch of the new tokens (decode when new == 1)."""
    from braid.runtime.cache.memory_pool import KVPool, ReqToTokenPool
    from braid.runtime.forward_batch import ForwardBatch, ForwardMode

    total = prefix + new
    per_req = -(-total // page_size)
    pool = KVPool(1, batch * per_req + 1, page_size, kvh, d, dtype, device)
    g = torch.Generator(device=device).manual_seed(0)
    for buf in pool.k + pool.v:
        buf.normal_(generator=g)
    table = ReqToTokenPool(batch + 1, total, device)
    pages = torch.randperm(batch * per_req, device=device, generator=g).view(batch, per_req) + 1
    offsets = torch.arange(per_req * page_size, device=device) % page_size
    slots = (pages.repeat_interleave(page_size, dim=1) * page_size + offsets)[:, :total]
    rows = [table.alloc() for _ in range(batch)]
    for r, s in zip(rows, slots):
        table.write(r, 0, s)
    mode = ForwardMode.DECODE if new == 1 and prefix > 0 else ForwardMode.EXTEND
    positions = torch.arange(prefix, total, device=device).repeat(batch)
    fb = ForwardBatch(
        mode=mode,
        input_ids=torch.zeros_like(positions),
        positions=positions,
        out_cache_loc=slots[:, prefix:].reshape(-1).contiguous(),
        req_pool_indices=torch.tensor(rows, device=device),
        seq_lens=torch.full((batch,), total, device=device),
        prefix_lens=[prefix] * batch,
        extend_lens=[new] * batch,
        logits_indices=torch.arange(batch, device=device),
    )
    n = batch * new
    qkv = [torch.randn(n, h, d, device=device, generator=g).to(dtype) for h in (heads, kvh, kvh)]
    return pool, table, fb, qkv


def backend_for(name, pool, table, heads=HEADS, kvh=KV_HEADS, d=HEAD_DIM, window=None):
    from braid.runtime.attention import create_backend

    kw = dict(num_heads=heads, num_kv_heads=kvh, head_dim=d, sliding_window=window)
    return create_backend(name, kv_pool=pool, req_to_token=table, **kw)


def _host_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    return times[len(times) // 2]


def _graph_us(backend, fb, qkv, timer: Timer) -> float:
    """One layer's decode forward captured through the backend's graph hooks (static batch of
    the same size, then the replay hook with the real batch), replayed `per_repeat` times."""
    from braid.runtime.forward_batch import ForwardBatch, ForwardMode

    bs, dev = fb.batch_size, fb.positions.device
    static = ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.zeros(bs, dtype=torch.int64, device=dev),
        positions=torch.zeros(bs, dtype=torch.int64, device=dev),
        out_cache_loc=fb.out_cache_loc.clone(),
        req_pool_indices=torch.zeros(bs, dtype=torch.int64, device=dev),
        seq_lens=torch.ones(bs, dtype=torch.int64, device=dev),
        prefix_lens=[0] * bs,
        extend_lens=[1] * bs,
        logits_indices=torch.arange(bs, device=dev),
    )
    q, k, v = (t.clone() for t in qkv)
    backend.init_cuda_graph_state(bs)
    backend.init_forward_metadata_capture_cuda_graph(static)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(q, k, v, 0, static)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(timer.per_repeat):
            backend.forward(q, k, v, 0, static)
    backend.init_forward_metadata_replay_cuda_graph(fb, bs)
    graph.replay()
    torch.cuda.synchronize()
    return timer._median_us(graph.replay)


def run_case(c: Case, dtype, device, timer: Timer, rates: dict) -> Case:
    pool, table, fb, qkv = build(c.batch, c.prefix, c.new, c.page_size, dtype, device)
    be = backend_for(c.backend, pool, table)
    c.plan_us = _host_us(partial(be.init_forward_metadata, fb), max(timer.repeats, 3))
    q, k, v = qkv
    native = backend_for("torch_native", pool, table)
    native.init_forward_metadata(fb)  # (metadata lives on the batch: the backend's comes next)
    want = native.forward(q.clone(), k, v, 0, fb).float()
    be.init_forward_metadata(fb)
    got = be.forward(q.clone(), k, v, 0, fb).float()
    c.max_abs_err = float((got - want).abs().max())
    c.eager_us = timer.eager(lambda: be.forward(q.clone(), k, v, 0, fb))
    esize = pool.k[0].element_size()
    if c.mode == "decode":
        ctx = c.prefix + c.new
        c.bytes = 2 * c.batch * ctx * KV_HEADS * HEAD_DIM * esize
        if device.type == "cuda":
            c.graph_us = _graph_us(be, fb, qkv, timer)
        if rates.get("bytes_per_s"):
            c.of_bound = c.bytes / rates["bytes_per_s"] * 1e6 / (c.graph_us or c.eager_us)
    else:
        visible = c.batch * HEADS * (c.new * c.prefix + c.new * (c.new + 1) // 2)
        c.flops = 4 * HEAD_DIM * visible
        if rates.get("flops_per_s"):
            c.of_bound = c.flops / rates["flops_per_s"] * 1e6 / c.eager_us
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return c


def cmd_bench(args) -> None:
    from benchmarks.common import copy_bandwidth, matmul_rate, write_result

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        sys.exit("attention_backends.py bench measures on a CUDA GPU; --smoke checks it on CPU")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    has_fi = importlib.util.find_spec("flashinfer") is not None and device.type == "cuda"
    decode, extend = DECODE, EXTEND
    if args.smoke:
        decode, extend = [(2, 40)], [(2, 5, 9)]
    rates: dict = {}
    if not args.smoke:
        rates.update(copy_bandwidth("cuda"))
        rates.update(matmul_rate("cuda", dtype=dtype))
    timer = Timer(device, 1 if args.smoke else args.repeats, 1 if args.smoke else args.per_repeat)
    backends = [("triton", 1)] + ([("flashinfer", 1), ("flashinfer", 16)] if has_fi else [])
    cases = [
        Case(b, ps, "decode", batch, ctx - 1, 1) for batch, ctx in decode for b, ps in backends
    ] + [Case(b, ps, "extend", *e) for e in extend for b, ps in backends]
    done = []
    with torch.inference_mode():
        for c in cases:
            try:
                done.append(run_case(c, dtype, device, timer, rates))
            except Exception as e:  # noqa: BLE001 - one failed case is reported, the rest run
                c.error = f"{type(e).__name__}: {e}"[:300]
                done.append(c)
            print(_row(done[-1]), flush=True)
    if args.smoke and args.out is None:
        return
    fields = {
        "dtype": str(dtype).removeprefix("torch."),
        "shapes": "Llama-3.1-8B attention (32 heads, 8 KV heads, head dim 128), one layer",
        "flashinfer": _fi_version(),
        "rates": rates,
        "repeats": timer.repeats,
        "per_repeat": timer.per_repeat,
        "cases": [asdict(c) for c in done],
    }
    write_result("attention_backends", device.type, args.out, fields)


def _fi_version() -> str | None:
    try:
        import flashinfer

        return flashinfer.__version__
    except ImportError:
        return None


def _row(c: Case) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    head = f"{c.mode:6} bs={c.batch:<4} prefix={c.prefix:<5} new={c.new:<5} "
    head += f"{c.backend:10} ps={c.page_size:<2}"
    if c.error:
        return f"{head} ERROR {c.error}"
    return (
        f"{head} plan {f(c.plan_us, '8.1f')} us  eager {f(c.eager_us, '9.1f')} us  "
        f"graph {f(c.graph_us, '9.1f')} us  of bound {f(c.of_bound, '.3f')}"
    )


# ---- jit ---------------------------------------------------------------------------------------


def exercise(variant: tuple) -> None:
    """Run a decode and an extend of `variant` through FlashInferBackend (compiling what it
    needs), checked against torch_native so a wrongly built kernel cannot pass silently."""
    dtype_name, d, heads, kvh, window = variant
    dtype, dev = getattr(torch, dtype_name), torch.device("cuda")
    for batch, prefix, new in [(4, 300, 1), (3, 40, 90)]:
        pool, table, fb, (q, k, v) = build(batch, prefix, new, 16, dtype, dev, heads, kvh, d)
        got, want = [], []
        for name, out in (("flashinfer", got), ("torch_native", want)):
            be = backend_for(name, pool, table, heads, kvh, d, window)
            be.init_forward_metadata(fb)
            out.append(be.forward(q.clone(), k, v, 0, fb).float())
        torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=2e-2)


def _cache_dir() -> Path | None:
    try:
        from flashinfer.jit import env

        return Path(env.FLASHINFER_WORKSPACE_DIR)
    except (ImportError, AttributeError):
        return None


def _du(path: Path | None) -> int | None:
    if path is None or not path.exists():
        return None
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _one_pass(variants, limit_s: float | None = None) -> tuple[float, list[dict]]:
    def run(i: int) -> dict:
        t0 = time.perf_counter()
        cmd = [sys.executable, __file__, "jit", "--one", str(JIT_VARIANTS.index(variants[i]))]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s)
            ok, tail = p.returncode == 0, (p.stdout + p.stderr)[-800:] if p.returncode else ""
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or "") + (e.stderr or "")
            if isinstance(out, bytes):
                out = out.decode(errors="replace")
            ok, tail = False, f"timed out after {limit_s} s: {out[-800:]}"
        return {
            "variant": variants[i],
            "seconds": round(time.perf_counter() - t0, 1),
            "ok": ok,
            "tail": tail,
        }

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(variants)) as pool:
        rows = list(pool.map(run, range(len(variants))))
    return round(time.perf_counter() - t0, 1), rows


def install_aot(cache: Path | None, out: str | None) -> list[str]:
    """Copy each module just built (`cached_ops/NAME/NAME.so`) to FlashInfer's AOT directory
    (`flashinfer/data/aot/NAME/NAME.so`), and to `out` in the same layout when given. A module
    found there is loaded as is; one found only in the JIT cache is handed to ninja first in
    every new process, and on the H200 (2026-12-02) that re-ran whole builds in each later
    process, 30 s and more apiece, after four builds had run at once (ninja's log and deps
    files are one per cache directory, shared by every module's build). `out` is what a later
    machine carries: copied into the installed package's data/aot, no JIT at all."""
    from flashinfer.jit import env

    names = []
    if cache is None:
        return names
    for so in sorted((cache / "cached_ops").glob("*/*.so")):
        name = so.parent.name
        for root in [env.FLASHINFER_AOT_DIR] + ([Path(out)] if out else []):
            (root / name).mkdir(parents=True, exist_ok=True)
            shutil.copy2(so, root / name / so.name)
        names.append(name)
    return names


def cmd_jit(args) -> None:
    from benchmarks.common import write_result

    if args.one is not None:
        exercise(JIT_VARIANTS[args.one])
        return
    if not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None:
        sys.exit("attention_backends.py jit needs a CUDA GPU and flashinfer-python")
    cache = _cache_dir()
    if args.clean and cache is not None and cache.exists():
        shutil.rmtree(cache)
    before = _du(cache) or 0
    variants = [JIT_VARIANTS[int(i)] for i in args.variants.split(",")] if args.variants else None
    cold, rows = _one_pass(variants or JIT_VARIANTS)
    for r in rows:
        print(f"  {r['variant']}: {r['seconds']} s {'ok' if r['ok'] else 'FAILED'}\n{r['tail']}")
    print(f"cold build, all variants at once: {cold} s", flush=True)
    fields = {
        "flashinfer": _fi_version(),
        "cpu_count": os.cpu_count(),
        "max_jobs": os.environ.get("MAX_JOBS"),
        "prefill_kernels": os.environ.get("BRAID_FLASHINFER_PREFILL") or "default",
        "cold_wall_s": cold,
        "cold": rows,
        "cache_dir": str(cache),
        "cache_bytes_before": before,
        "cache_bytes": _du(cache),
        "compiled_so_bytes": sum(p.stat().st_size for p in cache.rglob("*.so")) if cache else None,
    }
    fields["aot_modules"] = install_aot(cache, args.aot_out)
    script = "benchmarks/attention_backends.py"
    write_result("flashinfer_jit", "cuda", args.out, fields, script=script)  # before pass 2
    fields["cached_wall_s"], fields["cached"] = _one_pass(
        variants or JIT_VARIANTS, args.cached_limit
    )
    print(f"second pass (cached): {fields['cached_wall_s']} s", flush=True)
    print(json.dumps({k: v for k, v in fields.items() if k not in ("cold", "cached")}))
    write_result("flashinfer_jit", "cuda", args.out, fields, script=script)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench")
    b.add_argument("--repeats", type=int, default=20)
    b.add_argument("--per-repeat", type=int, default=10)
    b.add_argument("--smoke", action="store_true", help="tiny shapes on CPU; not a figure")
    b.add_argument("--out", default=None)
    j = sub.add_parser("jit")
    j.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    j.add_argument("--variants", default=None, help="indices into JIT_VARIANTS (default: all)")
    j.add_argument("--clean", action="store_true", help="empty FlashInfer's cache first")
    j.add_argument("--aot-out", default=None, help="also copy the built modules here")
    j.add_argument("--cached-limit", type=float, default=90, help="seconds per cached load")
    j.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.cmd == "bench" and args.smoke and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    (cmd_bench if args.cmd == "bench" else cmd_jit)(args)


if __name__ == "__main__":
    main()
