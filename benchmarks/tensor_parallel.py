"""Tensor parallelism on GPUs: the all-reduce, and braid at tp=1 against tp=2 in one run.

    python benchmarks/tensor_parallel.py allreduce
        NCCL all-reduce of one decode step's hidden states (batch 1 and 64, hidden 4096 and
        8192, bf16) between the GPUs: per call eagerly, and replayed from a CUDA graph as braid's
        decode graphs hold it; torch's symmetric-memory one-shot all-reduce beside it where it
        runs. Writes results/tensor_parallel_allreduce_<device>.json.
    python benchmarks/tensor_parallel.py engine --model llama-3.1-8b --tp 1,2 \\
        --figures decode,offline
    python benchmarks/tensor_parallel.py engine --model llama-3.1-70b --tp 2 \\
        --figures decode,prefill,offline
        One engine per tp size (random bf16 weights, load_format="dummy") runs the figures of
        benchmarks/gpu.py in turn: batch-1 decode, one 8k prefill, offline 1024 x (512 in,
        256 out). Each is set against one rank's share of the work: the decode roofline is
        the weight bytes one GPU holds / the copy rate plus the step's all-reduces (2 a layer,
        at the graph-replayed NCCL time measured first in this run); the prefill MFU counts one
        rank's FLOPs against one GPU's matmul rate; the offline bound is gpu_cost's with one
        rank's shapes (no all-reduce time: a lower bound). Writes
        results/tensor_parallel_<model>_<device>.json.
    --tiny-cpu: the same code paths at toy size on the CPU (tiny-llama, float32, gloo).

NVLink multicast stays off in every process this starts (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1), where the caller has not set them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

for _var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_var, "0" if _var == "NCCL_NVLS_ENABLE" else "1")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import gpu  # noqa: E402
from benchmarks.common import write_result  # noqa: E402
from benchmarks.offline_throughput import make_prompts  # noqa: E402
from braid.runtime.models.config import ModelConfig  # noqa: E402

# (hidden size, rows): one decode step's all-reduce for the 8B and 70B shapes, batch 1 and 64.
ALLREDUCE_SHAPES = [(4096, 1), (4096, 64), (8192, 1), (8192, 64)]
TINY_SHAPES = [(64, 1), (64, 8)]
# Issue 24's targets: 70B batch-1 decode against the tp=2 roofline, 8B tp=2 over tp=1.
TARGETS = {"decode_70b_fraction": 0.80, "decode_8b_speedup": 1.5}
SCRIPT = "benchmarks/tensor_parallel.py"


# ---- the all-reduce ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time_us(fn, device: torch.device, calls: int) -> float:
    """Mean microseconds per call of `fn` over `calls` back-to-back calls (CUDA events on a
    GPU), the best of 5 such rounds."""
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) * 1e3 / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - t0) * 1e6 / calls)
    return best


def _allreduce_rank(rank: int, size: int, port: int, shapes, dtype_name: str, queue) -> None:
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= size
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
    )
    dtype = getattr(torch, dtype_name)
    rows = []
    try:
        for hidden, batch in shapes:
            x = torch.ones(batch, hidden, dtype=dtype, device=device)
            row = {"hidden": hidden, "rows": batch, "bytes": x.numel() * x.element_size()}
            dist.all_reduce(x)  # the communicator exists before anything is timed or captured
            dist.barrier()
            row["eager_us"] = _time_us(lambda x=x: dist.all_reduce(x), device, 200)
            if cuda:
                row.update(_graph_allreduce(x, device, dist))
                row.update(_one_shot(x, device, dist))
            rows.append(row)
        if rank == 0:
            queue.put(rows)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _graph_allreduce(x: torch.Tensor, device: torch.device, dist) -> dict:
    """NCCL all-reduces replayed from a CUDA graph (as braid's decode graphs hold them)."""
    per_graph = 64
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(stream):
            dist.all_reduce(x)
        torch.cuda.current_stream(device).wait_stream(stream)
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(per_graph):
                dist.all_reduce(x)
        torch.cuda.synchronize(device)
        return {"graph_us": _time_us(graph.replay, device, 20) / per_graph}
    except RuntimeError as e:
        return {"graph_error": f"{type(e).__name__}: {e}"[:300]}


def _one_shot(x: torch.Tensor, device: torch.device, dist) -> dict:
    """torch's symmetric-memory one-shot all-reduce (each GPU reads its peers' buffers over
    NVLink, no multicast), eager and in a CUDA graph, where this torch has it."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD.group_name
        buf = symm_mem.empty(x.shape, dtype=x.dtype, device=device)
        symm_mem.rendezvous(buf, group)
        buf.copy_(x)
        op = torch.ops.symm_mem.one_shot_all_reduce
        torch.cuda.synchronize(device)
        out = {"one_shot_eager_us": _time_us(lambda: op(buf, "sum", group), device, 200)}
        per_graph = 64
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(per_graph):
                op(buf, "sum", group)
        torch.cuda.synchronize(device)
        out["one_shot_graph_us"] = _time_us(graph.replay, device, 20) / per_graph
        return out
    except Exception as e:  # not in this torch, or not on this machine: said in the JSON
        return {"one_shot_error": f"{type(e).__name__}: {e}"[:300]}


def best_us(row: dict) -> float:
    """A row's all-reduce time per call: replayed from a CUDA graph where captured (as braid's
    decode runs it), else eager."""
    return row.get("graph_us", row["eager_us"])


def measure_allreduce(size: int, shapes, dtype: str, timeout_s: float = 240.0) -> list[dict]:
    """Rank 0's rows of the all-reduce timings, measured by `size` spawned processes."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_allreduce_rank, args=(r, size, port, shapes, dtype, queue))
        for r in range(size)
    ]
    for p in procs:
        p.start()
    try:
        rows = queue.get(timeout=timeout_s)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for row in rows:
        best = best_us(row)
        print(
            f"all-reduce {row['rows']} x {row['hidden']} ({row['bytes']} B): "
            f"eager {row['eager_us']:.1f} us, graph {row.get('graph_us', float('nan')):.1f} us, "
            f"one-shot graph {row.get('one_shot_graph_us', float('nan')):.1f} us "
            f"-> per layer (2 calls) {2 * best:.1f} us",
            flush=True,
        )
    return rows


# ---- engines ----------------------------------------------------------------------------------


def _figure_args(args: argparse.Namespace) -> argparse.Namespace:
    sizes = gpu.SIZES["tiny" if args.tiny_cpu else "gpu"]
    return argparse.Namespace(
        repeats=args.repeats or sizes["repeats"],
        input_len=sizes["decode_input_len"],
        output_len=sizes["decode_output_len"],
        prompt_len=sizes["prompt_len"],
        skip_hf=True,
    )


def engine_figures(
    run: gpu.Run,
    figures: list[str],
    fargs: argparse.Namespace,
    out: dict,
    saved: Callable[[], None],
    profile_dir: str | None = None,
) -> dict:
    """Every figure in `figures` on one engine, in order (decode, prefill, offline), into
    `out`, calling `saved` after each. With `profile_dir`, first a torch profile of rank 0
    over one batch-1 request of 32 tokens (`LLM.start_profile`)."""
    llm, engine = gpu.start_engine(run)
    out["engine"] = engine
    try:
        if profile_dir:
            vocab = run.model_config.vocab_size
            gpu.timed_generate(llm, make_prompts(1, 128, vocab, seed=7), 32)
            llm.start_profile(profile_dir)
            gpu.timed_generate(llm, make_prompts(1, 128, vocab, seed=8), 32)
            out["profile_files"] = llm.stop_profile()
        if "decode" in figures:
            out["decode"], _ = gpu.measure_decode(llm, engine, run, fargs)
            saved()
        if "prefill" in figures:
            out["prefill"], _ = gpu.measure_prefill(llm, engine, run, fargs)
            saved()
        if "offline" in figures:
            sizes = gpu.SIZES["tiny" if fargs.tiny else "gpu"]
            off = argparse.Namespace(
                num_prompts=sizes["num_prompts"],
                input_len=sizes["input_len"],
                output_len=sizes["output_len"],
            )
            out["offline"], _ = gpu.measure_offline(llm, engine, run, off)
    finally:
        gpu.stop_engine(run, llm)
    for fig in figures:
        out[fig].pop("engine", None)  # the same engine for every figure: kept once
    return out


def decode_roofline(run: gpu.Run, step_allreduce_s: float) -> dict:
    """One rank's batch-1 decode roofline: its weight bytes at the copy rate, plus the step's
    all-reduces (which no rank overlaps with its weight reads)."""
    weights_s = run.cost.weight_bytes / run.copy_bytes_per_s
    step_s = weights_s + step_allreduce_s
    return {
        "rank_weight_bytes": run.cost.weight_bytes,
        "weights_s": weights_s,
        "allreduce_s": step_allreduce_s,
        "step_s": step_s,
        "roofline_tok_s": 1.0 / step_s,
    }


def run_engines(args: argparse.Namespace) -> dict:
    device = "cpu" if args.tiny_cpu else "cuda"
    dtype = "float32" if args.tiny_cpu else "bfloat16"
    tps = [int(t) for t in args.tp.split(",")]
    figures = args.figures.split(",")
    unknown = set(figures) - {"decode", "prefill", "offline"}
    if unknown:
        sys.exit(f"--figures: unknown {sorted(unknown)} (decode, prefill, offline)")
    fargs = _figure_args(args)
    fargs.tiny = args.tiny_cpu
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = gpu.tiny_model_dir(tmp) if args.tiny_cpu else gpu.CONFIGS / args.model
        cfg = ModelConfig.from_dir(model_dir)
        copy, mm = gpu.measure_rates(device, getattr(torch, dtype), args.tiny_cpu)
        print(
            f"copy {copy['bytes_per_s'] / 1e12:.3f} TB/s, matmul {mm['flops_per_s'] / 1e12:.1f} "
            "TFLOP/s (one device)",
            flush=True,
        )
        ar_rows: list[dict] = []
        if max(tps) > 1:
            shape = (cfg.hidden_size, 1)
            ar_rows = measure_allreduce(max(tps), [shape], dtype)
        per_call_s = best_us(ar_rows[0]) * 1e-6 if ar_rows else 0.0
        result: dict = {
            "model": args.model if not args.tiny_cpu else "tiny-llama",
            "dtype": dtype,
            "copy_bandwidth": copy,
            "matmul": mm,
            "allreduce_batch1": ar_rows,
            "targets": TARGETS,
            "tp": {},
        }
        for tp in tps:
            engine_args = {"device": device, "tp_size": tp, **args.engine_args}
            if args.tiny_cpu:
                engine_args.setdefault("kv_tokens", 16384)
            run = gpu.make_run(
                model_dir, result["model"], cfg, device, dtype, engine_args, (copy, mm), tp
            )
            print(f"\n== tp={tp}: {run.model_name}, engine args {engine_args}", flush=True)
            res = result["tp"].setdefault(str(tp), {})
            profile = f"{args.profile_dir}/tp{tp}" if args.profile_dir else None
            engine_figures(run, figures, fargs, res, lambda: _save(args, device, result), profile)
            if "decode" in res:
                step_ar = 2 * cfg.num_layers * per_call_s if tp > 1 else 0.0
                roof = decode_roofline(run, step_ar)
                dec = res["decode"]
                # gpu.py's target is one GPU's against the weights alone: not this figure's.
                for key in ("target_fraction", "meets_target"):
                    dec.pop(key, None)
                dec["tp_roofline"] = roof
                dec["fraction_of_tp_roofline"] = dec["braid_tok_s"] / roof["roofline_tok_s"]
            res["graph_capture_s"] = res["engine"]["phases_s"].get("graphs")
            _print_tp(tp, res)
            _save(args, device, result)  # after every engine: a later failure keeps these
    _ratios(result)
    _save(args, device, result)
    return result


def _ratios(result: dict) -> None:
    one, two = result["tp"].get("1"), result["tp"].get("2")
    if not (one and two):
        return
    ratios = {}
    for fig in ("decode", "prefill", "offline"):
        if fig in one and fig in two:
            ratios[fig] = two[fig]["braid_tok_s"] / one[fig]["braid_tok_s"]
    result["tp2_over_tp1"] = ratios
    print("tp=2 / tp=1:", json.dumps({k: round(v, 3) for k, v in ratios.items()}), flush=True)


def _print_tp(tp: int, res: dict) -> None:
    if "decode" in res:
        d = res["decode"]
        steps = d["braid_decode_tok_s"] or 0.0
        print(
            f"tp={tp} decode {d['braid_tok_s']:.1f} tok/s (steps {steps:.1f})"
            f", tp roofline {d['tp_roofline']['roofline_tok_s']:.1f}: "
            f"{d['fraction_of_tp_roofline']:.3f}",
            flush=True,
        )
    if "prefill" in res:
        p = res["prefill"]
        print(f"tp={tp} prefill {p['braid_tok_s']:.0f} tok/s, MFU/GPU {p['mfu']:.3f}", flush=True)
    if "offline" in res:
        o = res["offline"]
        print(
            f"tp={tp} offline {o['braid_tok_s']:.0f} tok/s, {o['fraction_of_bound']:.3f} of the "
            f"per-rank bound ({o['bound_tok_s']:.0f})",
            flush=True,
        )
    print(f"tp={tp} graph capture {res['graph_capture_s']} s", flush=True)


def _save(args: argparse.Namespace, device: str, result: dict) -> None:
    name = "tiny-llama" if args.tiny_cpu else args.model
    write_result(f"tensor_parallel_{name}", device, args.out, result, script=SCRIPT)


# ---- command line -----------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("what", choices=["allreduce", "engine"])
    ap.add_argument("--tiny-cpu", action="store_true", help="toy sizes on the CPU over gloo")
    ap.add_argument("--model", default="llama-3.1-8b", help="a config under benchmarks/configs")
    ap.add_argument("--tp", default="1,2", help="tp sizes, comma-separated (engine)")
    ap.add_argument("--figures", default="decode,offline", help="decode,prefill,offline")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default=None, help="JSON path")
    ap.add_argument("--profile-dir", default=None, help="engine: a torch profile of rank 0 here")
    args = ap.parse_args()
    if not args.tiny_cpu and torch.cuda.device_count() < 2:
        sys.exit(
            "benchmarks/tensor_parallel.py: needs 2 CUDA devices "
            f"(this machine has {torch.cuda.device_count()}); --tiny-cpu runs the code paths "
            "on the CPU over gloo"
        )
    args.engine_args = gpu.parse_engine_args(args.engine_arg)
    device = "cpu" if args.tiny_cpu else "cuda"
    if args.what == "allreduce":
        shapes = TINY_SHAPES if args.tiny_cpu else ALLREDUCE_SHAPES
        rows = measure_allreduce(2, shapes, "float32" if args.tiny_cpu else "bfloat16")
        for row in rows:
            row["per_layer_us"] = 2 * best_us(row)
        summary = {
            "ranks": 2,
            "rows": rows,
            "median_graph_us": statistics.median(best_us(r) for r in rows),
            "notes": "per call: the mean over back-to-back calls, best of 5 rounds; "
            "per_layer_us: the two all-reduces of a decoder layer (graph time where captured)",
        }
        write_result("tensor_parallel_allreduce", device, args.out, summary, script=SCRIPT)
        return
    run_engines(args)


if __name__ == "__main__":
    main()
