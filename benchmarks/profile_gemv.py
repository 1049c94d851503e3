"""The one-row GEMVs under Nsight Compute: where each kernel's time goes at Llama-3.1-8B's
shapes (why the int4 GEMV reads at 0.3-0.54 of the copy rate where fp8's tensor-core form
reaches 0.88 and cuBLAS's bf16 0.74-0.95).

    ncu --clock-control none --profile-from-start off --set full -f -o /tmp/gemv \\
        python benchmarks/profile_gemv.py
    ncu -i /tmp/gemv.ncu-rep --page raw --csv > raw.csv
    python benchmarks/profile_gemv.py --summarize raw.csv     # here or on any machine

Run under ncu, the script builds each case's weights, runs every case once (compiling it),
then launches each case once between cudaProfilerStart and cudaProfilerStop, in the order
it prints (an NVTX range names each), so the report holds one kernel per case in that order
(ncu flushes the caches before each: cold weights, as in decode). `--summarize` reads
ncu's raw page (CSV) and prints, per kernel, its time, the DRAM bytes and rate, the
occupancy it reached, its issue activity and the stall reasons that dominate, and writes
them as JSON (`--out`, else benchmarks/results/profile_gemv_<device>.json), with the GPU the
raw page names.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GROUP = 128
# (label, method, N, K, GemvConfig fields or None for cuBLAS): the H200's recorded choices
# (configs/quant_gemv.json), the same with the splits launched first, and the contrasts.
CASES = [
    ("int4 qkv packed", "int4", 6144, 4096, (256, 128, 16, 4, 2, False, True)),
    ("int4 qkv packed sf", "int4", 6144, 4096, (256, 128, 16, 4, 2, False, True, True)),
    ("int4 qkv zero-last", "int4", 6144, 4096, (256, 128, 16, 4, 2, False, 2)),
    ("int4 o packed", "int4", 4096, 4096, (128, 128, 16, 4, 2, False, True)),
    ("int4 gate_up packed", "int4", 28672, 4096, (256, 256, 8, 4, 2, False, True)),
    ("int4 gate_up packed sf", "int4", 28672, 4096, (256, 256, 8, 4, 2, False, True, True)),
    ("int4 gate_up zero-last", "int4", 28672, 4096, (256, 256, 8, 4, 2, False, 2)),
    ("int4 gate_up packed 1 wave", "int4", 28672, 4096, (512, 128, 4, 4, 2, False, True)),
    ("int4 gate_up float32", "int4", 28672, 4096, (128, 128, 4, 4, 4)),
    ("int4 down packed", "int4", 4096, 14336, (256, 128, 16, 4, 3, False, True)),
    ("int4 down packed sf", "int4", 4096, 14336, (256, 128, 16, 4, 3, False, True, True)),
    # The prologues (`int4_gemv`'s activation and norm), slower than the separate kernels.
    ("int4 down packed silu", "int4 silu", 4096, 14336, (256, 128, 16, 4, 3, False, True)),
    ("int4 gate_up packed norm", "int4 norm", 28672, 4096, (256, 256, 8, 4, 2, False, True)),
    ("fp8 gate_up dot", "fp8", 28672, 4096, (128, 256, 1, 4, 3, True)),
    ("fp8 down", "fp8", 4096, 14336, (64, 256, 4, 4, 3)),
    ("bf16 gate_up cuBLAS", "bf16", 28672, 4096, None),
    ("bf16 down cuBLAS", "bf16", 4096, 14336, None),
]

# Raw-page metrics the summary keeps (ncu 2025 names), with short names.
METRICS = {
    "gpu__time_duration.sum": "us",
    "dram__bytes_read.sum": "dram_read_bytes",
    "dram__bytes_read.sum.pct_of_peak_sustained_elapsed": "dram_pct_of_peak",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    "sm__maximum_warps_per_active_cycle_pct": "theoretical_occupancy_pct",
    "smsp__warps_active.avg.per_cycle_active": "warps_per_scheduler",
    "launch__registers_per_thread": "registers",
    "launch__occupancy_limit_registers": "blocks_per_sm_by_registers",
    "launch__occupancy_limit_shared_mem": "blocks_per_sm_by_shared_mem",
    "launch__grid_size": "programs",
    "launch__waves_per_multiprocessor": "waves",
    "sm__inst_executed.avg.per_cycle_active": "ipc_per_sm",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue_active_pct",
    "smsp__inst_executed.sum": "warp_instructions",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct_of_peak",
    "lts__t_sector_hit_rate.pct": "l2_hit_pct",
    "smsp__average_warp_latency_per_inst_issued.ratio": "warp_cycles_per_issue",
}
# ncu's units of time and size, in the summary's (microseconds, bytes); ncu writes either
# spelling of the times.
UNITS = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "ns": 1e-3, "us": 1.0, "ms": 1e3}
UNITS |= {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}
SCALED = ("gpu__time_duration.sum", "dram__bytes_read.sum")
# Helper kernels a case may launch after its own (cuBLAS's split-K reduction): they belong
# to the case before them.
HELPERS = ("splitKreduce",)
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"


def run_cases(smoke: bool = False) -> None:
    """Each case once to compile, then once each between the profiler's start and stop.
    `smoke`: the same calls at toy sizes on the CPU (Triton's interpreter), no profiler."""
    import torch
    import torch.nn.functional as F

    from braid.kernels.int4_gemv import int4_gemv
    from braid.kernels.quant_gemv import GemvConfig, fp8_gemv
    from braid.kernels.quant_reference import (
        FP8_DTYPE,
        pack_int4,
        pack_int4_meta,
        pack_int4_planar,
    )

    dev = torch.device("cpu" if smoke else "cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    calls = []
    for label, method, n, k, fields in CASES:
        if smoke:
            n, k = min(n, 64) * (2 if "gate_up" in label else 1), 256
            if fields is not None:
                fields = (16, *fields[1:])
        x = torch.randn(1, k, generator=gen, device=dev).bfloat16()
        if method.startswith("int4"):
            q = pack_int4(torch.randint(0, 16, (n, k), generator=gen, device=dev))
            s = ((torch.rand(k // GROUP, n, generator=gen, device=dev) + 0.5) / 64).half()
            z = torch.randint(0, 16, (k // GROUP, n), generator=gen, device=dev).to(torch.uint8)
            planar, meta, cfg = pack_int4_planar(q), pack_int4_meta(s, z), GemvConfig(*fields)
            kw: dict = {}
            if method == "int4 silu":
                x = torch.randn(1, 2 * k, generator=gen, device=dev).bfloat16()
                kw = {"activation": "silu_and_mul"}
            elif method == "int4 norm":
                kw = {"norm_weight": x[0].clone(), "residual": x.clone()}
                kw["residual_out"] = torch.empty_like(x)

            def call(x=x, planar=planar, meta=meta, cfg=cfg, kw=kw):
                return int4_gemv(x, planar, meta, GROUP, config=cfg, **kw)
        elif method == "fp8":
            w = (torch.randn(n, k, generator=gen, device=dev) * 0.5).to(FP8_DTYPE)
            scales = torch.rand(n, generator=gen, device=dev) / 100 + 1e-3
            cfg = GemvConfig(*fields)

            def call(x=x, w=w, scales=scales, cfg=cfg):
                return fp8_gemv(x, w, scales, config=cfg)
        else:
            w = torch.randn(n, k, generator=gen, device=dev).bfloat16()

            def call(x=x, w=w):
                return F.linear(x, w)

        call()  # compiles (Triton) or picks the kernel (cuBLAS), outside the profiled range
        calls.append((label, call))
    if smoke:
        for i, (label, _) in enumerate(calls):
            print(f"case {i}: {label}", flush=True)
        return
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for i, (label, call) in enumerate(calls):
        torch.cuda.nvtx.range_push(label)
        call()
        torch.cuda.nvtx.range_pop()
        print(f"case {i}: {label}", flush=True)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def summarize(raw_csv: Path) -> list[dict]:
    """One row per profiled kernel of ncu's raw page: `METRICS` and the stall reasons (warps
    stalled per issued instruction, the largest first), labelled with `CASES` in order."""
    with raw_csv.open(newline="") as f:
        table = [row for row in csv.reader(f) if row]
    header, units, data = table[0], table[1], table[2:]
    rows = []
    case = -1
    for values in data:
        got = dict(zip(header, values, strict=False))
        unit = dict(zip(header, units, strict=False))
        kernel = got.get("Kernel Name") or ""
        helper = any(name in kernel for name in HELPERS)
        case += not helper
        label = CASES[case][0] if 0 <= case < len(CASES) else None
        row = {"case": f"{label} (helper)" if helper else label, "kernel": kernel}
        for metric, name in METRICS.items():
            value = _number(got.get(metric, ""))
            if value is not None and metric in SCALED:
                if unit.get(metric) not in UNITS:
                    raise ValueError(f"{raw_csv}: {metric} in unknown unit {unit.get(metric)!r}")
                value *= UNITS[unit[metric]]
            row[name] = value
        stalls = {}
        for metric, text in got.items():
            if metric.startswith(STALL_PREFIX) and metric.endswith(STALL_SUFFIX):
                value = _number(text)
                if value:
                    stalls[metric.removeprefix(STALL_PREFIX).removesuffix(STALL_SUFFIX)] = value
        row["stalls"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:6])
        row["gpu"] = got.get("device__attribute_display_name")
        if row.get("us") and row.get("dram_read_bytes"):
            row["dram_read_tb_per_s"] = row["dram_read_bytes"] / (row["us"] * 1e-6) / 1e12
        rows.append(row)
    for row in rows:
        stalls = ", ".join(f"{k} {v:.1f}" for k, v in list(row["stalls"].items())[:4])
        print(
            f"{(row['case'] or row['kernel'])[:30]:30s} {row.get('us') or 0:7.2f} us  "
            f"dram {row.get('dram_read_tb_per_s') or 0:4.2f} TB/s "
            f"({row.get('dram_pct_of_peak') or 0:4.1f}% of peak)  "
            f"warps/scheduler {row.get('warps_per_scheduler') or 0:4.1f} "
            f"(occupancy {row.get('achieved_occupancy_pct') or 0:4.1f}% "
            f"of {row.get('theoretical_occupancy_pct') or 0:4.1f})  "
            f"issue {row.get('issue_active_pct') or 0:4.1f}%  stalls: {stalls}"
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--summarize", type=Path, default=None, help="ncu's raw page as CSV")
    ap.add_argument("--smoke", action="store_true", help="the cases at toy sizes on the CPU")
    ap.add_argument("--out", default=None, help="JSON path (with --summarize)")
    args = ap.parse_args(argv)
    if args.summarize is None:
        if args.smoke:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        run_cases(args.smoke)
        return
    import torch

    from benchmarks.common import write_result

    rows = summarize(args.summarize)
    # The machine's record names the GPU where the summary runs beside the profile.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    write_result(
        "profile_gemv", device, args.out, {"cases": [c[0] for c in CASES], "rows": rows},
        script="benchmarks/profile_gemv.py",
    )  # fmt: skip


if __name__ == "__main__":
    main()
