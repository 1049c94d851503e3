"""Sweep the decode-attention split kernel's (BLOCK_N, num_warps, num_stages) on this GPU.

    python benchmarks/tune_attention.py      # Llama-3.1-8B heads (32 q, 8 kv, dim 128), bf16
    python benchmarks/tune_attention.py --kv-dtype fp8_e4m3 --write-config   # an fp8 KV cache

For each case (batch, sequence length) it times `decode_attention` at braid's split count for
that batch (`triton_backend.kv_splits_for_batch`), CUDA events over back-to-back launches, for every
config, and reports each config's time and its fraction of the copy bound (the K/V bytes read
/ the copy rate measured in the same run). `--write-config` records the config nearest each
case's best over all cases (the sum of time / case best) for this GPU, head size and KV dtype
in braid/kernels/configs/decode_attention.json, which `attention_decode.launch_config` reads;
without an entry the kernel takes `_stage1_config`'s built-in choice, which was chosen from
this table for bf16 (the committed JSON was timed with back-to-back eager launches, so
its batch-1 row measured launch time; the script now times CUDA graphs). Writes
benchmarks/results/tune_attention_cuda.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import copy_bandwidth, write_result  # noqa: E402
from braid.kernels.attention_decode import (  # noqa: E402
    TUNED_CONFIGS,
    _stage1_config,
    decode_attention,
    launch_config,
    tuned_key,
)
from braid.kernels.reference import KV_FP8_DTYPE  # noqa: E402
from braid.runtime.attention.triton_backend import kv_splits_for_batch  # noqa: E402

CASES = [(1, 4096), (32, 4096), (256, 640), (1024, 640)]
CONFIGS = list(itertools.product((32, 64, 128), (4, 8), (2, 3, 4)))
# An fp8 block of keys is half the bytes: longer blocks too; and each converted to q's dtype
# (0), to float16 (1: one instruction per pair of e4m3 values), or to float16 from 32-bit words
# before the dot's layout change (2). (Float32 products on the CUDA cores, the group of 4 query
# heads not padded to tl.dot's 16 rows, ran 5-9x slower than the best at every case on the
# H200; the scores transposed, [keys, heads], 10-13% slower than mode 2: docs/benchmarks.md.)
FP8_CONFIGS = [
    (*c, mode)
    for c in CONFIGS + list(itertools.product((256,), (4, 8), (2, 3)))
    for mode in (0, 1, 2)
]
KV_DTYPES = {"bfloat16": torch.bfloat16, "fp8_e4m3": KV_FP8_DTYPE}


def time_us(fn, repeats: int = 20) -> float:
    """Device time per call, from a CUDA graph of `repeats` calls: the small cases' kernels
    take less time than launching them from Python."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / repeats


def tune_case(
    bs: int, seq: int, copy_bytes_per_s: float, kv_dtype: torch.dtype, only: list | None = None
) -> dict:
    dev, dtype = torch.device("cuda"), torch.bfloat16
    heads, kv_heads, dim = 32, 8, 128
    k = torch.randn(bs * seq + 1, kv_heads, dim, device=dev, dtype=dtype).to(kv_dtype)
    v = torch.randn(bs * seq + 1, kv_heads, dim, device=dev, dtype=dtype).to(kv_dtype)
    q = torch.randn(bs, heads, dim, device=dev, dtype=dtype)
    table = (1 + torch.arange(bs * seq, device=dev)).view(bs, seq)
    rows_idx = torch.arange(bs, device=dev)
    lens = torch.full((bs,), seq, device=dev)
    splits = kv_splits_for_batch(bs, kv_heads)
    kv_bytes = 2 * bs * seq * kv_heads * dim * k.element_size()
    # A copy's rate counts bytes read + written: HBM moves that many bytes a second either way.
    bound_us = kv_bytes / copy_bytes_per_s * 1e6

    def launch(cfg: tuple[int, ...]) -> None:
        decode_attention(
            q, k, v, table, rows_idx, lens, dim**-0.5, num_kv_splits=splits, stage1_config=cfg
        )

    results = {}
    fp8 = kv_dtype == KV_FP8_DTYPE
    default = _stage1_config(dim) + ((0,) if fp8 else ())
    used = tuple(launch_config(dim, kv_dtype, dev, dtype))  # the tuned entry if there is one
    if fp8 and len(used) == 3:
        used += (0,)
    configs = only or (FP8_CONFIGS if fp8 else CONFIGS)
    for cfg in dict.fromkeys([default, used, *configs]):
        try:
            results[cfg] = time_us(lambda cfg=cfg: launch(cfg))
        except Exception as e:  # a config the compiler rejects (shared memory): skip it
            print(f"bs {bs} seq {seq} {cfg}: {type(e).__name__}")
    best = min(results, key=results.get)
    print(
        f"bs {bs:5d} seq {seq:5d} splits {splits:2d}: built-in {default} "
        f"{results[default]:8.1f} us ({bound_us / results[default]:.0%} of read bound), "
        f"in use {used} {results.get(used, float('nan')):8.1f} us, "
        f"best {best} {results[best]:8.1f} us ({bound_us / results[best]:.0%})",
        flush=True,
    )
    return {
        "batch": bs,
        "seq": seq,
        "splits": splits,
        "kv_bytes": kv_bytes,
        "read_bound_us": bound_us,
        "default": list(default),
        "default_us": results[default],
        "in_use": list(used),
        "in_use_us": results.get(used),
        "best": list(best),
        "best_us": results[best],
        "all": {"/".join(map(str, c)): us for c, us in results.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv-dtype", choices=tuple(KV_DTYPES), default="bfloat16")
    ap.add_argument("--write-config", action="store_true", help="record the best overall")
    ap.add_argument(
        "--configs",
        default=None,
        help="only these configs (and the built-in and in-use ones), e.g. '128,4,4,1;128,4,4,2'",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    only = None
    if args.configs:
        only = [tuple(int(x) for x in c.split(",")) for c in args.configs.split(";") if c]
    if not torch.cuda.is_available():
        sys.exit("benchmarks/tune_attention.py: needs a CUDA device")
    kv_dtype = KV_DTYPES[args.kv_dtype]
    copy = copy_bandwidth("cuda")
    rows = []
    for bs, seq in CASES:
        rows.append(tune_case(bs, seq, copy["bytes_per_s"], kv_dtype, only))
        torch.cuda.empty_cache()
    # The config closest to each case's best over all cases (sum of time / case best).
    common = set.intersection(*(set(r["all"]) for r in rows))
    overall = min(common, key=lambda c: sum(r["all"][c] / r["best_us"] for r in rows))
    print(f"best overall (sum of time / case best): {overall}")
    if args.write_config:
        configs = json.loads(TUNED_CONFIGS.read_text()) if TUNED_CONFIGS.is_file() else {}
        entries = configs.setdefault(torch.cuda.get_device_name(), {})
        entries[tuned_key(128, kv_dtype)] = [int(x) for x in overall.split("/")]
        TUNED_CONFIGS.parent.mkdir(parents=True, exist_ok=True)
        TUNED_CONFIGS.write_text(json.dumps(configs, indent=2, sort_keys=True) + "\n")
        print(f"wrote {TUNED_CONFIGS}: {tuned_key(128, kv_dtype)} = {overall}")
    write_result(
        "tune_attention",
        "cuda",
        args.out,
        {
            "kv_dtype": args.kv_dtype,
            "copy_bandwidth": copy,
            "cases": rows,
            "best_overall": overall,
        },
        script="benchmarks/tune_attention.py",
    )


if __name__ == "__main__":
    main()
