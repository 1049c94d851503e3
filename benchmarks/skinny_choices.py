"""Collect the skinny GEMM autotuner's choices from a Triton cache into
braid/kernels/configs/skinny_gemm.json, for this machine's GPU.

The autotuner keeps each case's timings on disk (`*.autotune.json` beside the compiled
kernels); this reads those of `_skinny_gemm_kernel`, takes each case's fastest configuration
and merges them under `torch.cuda.get_device_name()`. With the table, a fresh machine of that
GPU compiles one configuration per case instead of benchmarking all of them (`skinny_gemm`'s
`known_choice`). Run it on the GPU machine after a start that tuned the cases (e.g. `braid
serve` with CUDA graphs: its batch-1 graph runs every fused case of the model):

    python benchmarks/skinny_choices.py --cache ~/.cache/braid/triton --out /tmp/skinny_gemm.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from braid.kernels.skinny_gemm import TUNED_CONFIGS, tuned_key  # noqa: E402

KERNEL = "_skinny_gemm_kernel"


def choices(cache: Path) -> dict[str, list[int]]:
    """{tuned_key: [BLOCK_N, BLOCK_K, num_warps, num_stages]} of every case tuned in `cache`."""
    out = {}
    for path in sorted(cache.rglob(f"{KERNEL}.autotune.json")):
        record = json.loads(path.read_text())
        # The autotuner's key: N, K, ACTIVATION, ONE_ROW, NORM, HAS_RESIDUAL, then the dtype of
        # each tensor argument, X's first.
        n, k, activation, one_row, norm, residual, x_dtype = record["key"][:7]
        dtype = getattr(torch, str(x_dtype).removeprefix("torch."))
        best, _ = min(record["configs_timings"], key=lambda ct: ct[1])
        key = tuned_key(n, k, dtype, activation, bool(one_row), bool(norm), bool(residual))
        kw = best["kwargs"]
        out[key] = [kw["BLOCK_N"], kw["BLOCK_K"], best["num_warps"], best["num_stages"]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cache", type=Path, required=True, help="a Triton cache directory")
    ap.add_argument("--out", type=Path, default=TUNED_CONFIGS, help="the table to merge into")
    args = ap.parse_args()
    name = torch.cuda.get_device_name()
    found = choices(args.cache)
    table = json.loads(args.out.read_text()) if args.out.is_file() else {}
    table.setdefault(name, {}).update(found)
    table[name] = dict(sorted(table[name].items()))
    args.out.write_text(json.dumps(table, indent=2) + "\n")
    for key, config in sorted(found.items()):
        print(f"{name}: {key} -> {config}")
    print(f"wrote {len(found)} choices to {args.out}")


if __name__ == "__main__":
    main()
