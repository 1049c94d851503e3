"""Sweep the extend-attention kernel's launch configuration (BLOCK_M, BLOCK_N, num_warps,
num_stages[, pack]) on this GPU, in both forms: one program per query head, and packed, one
program per KV head with its GROUP query heads in one tile (BLOCK_M new tokens x GROUP heads).

    python benchmarks/tune_extend.py          # Llama-3.1-8B heads (32 q, 8 kv, dim 128), bf16
    python benchmarks/tune_extend.py --pack 1 # the packed configurations only
    python benchmarks/tune_extend.py --smoke  # tiny shapes, 2 configs: runs on CPU (interpreter)
    python benchmarks/tune_extend.py --smoke --pack both  # and a packed one

Cases (batch, cached prefix, new tokens per request): 1 x 4096 and 16 x 512 new tokens (issue
21's two points: the target is >= 50% of the matmul rate) and 4 x (1024 cached + 1024 new), a
chunked prefill. The default configuration's output is checked against the torch reference, then
each configuration's against the default's (a wrong one is reported, not timed); each is timed
with CUDA events over back-to-back calls, median of the repeats, and reported as its fraction of
the bf16 matmul rate measured in the same run (attention FLOPs: 4 x head dim per visible query-
key pair, causal), beside the built-in default's. The chosen configuration is the one whose
worst case is nearest that case's best; `--write-config` records it for this GPU in
braid/kernels/configs/extend_attention.json (`ExtendConfig.fields()`: four fields, or five
ending in 1 when packed), which `launch_config` in braid/kernels/extend_config.py reads: the best
unpacked config under "128/bfloat16" for every model, and a packed winner under "128/bfloat16/g4"
for models of this sweep's GROUP (4) alone. Configs are reported in that form too. Writes
benchmarks/results/tune_extend_<device>.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import _elapsed_s, matmul_rate, write_result  # noqa: E402
from braid.kernels.attention_extend import (  # noqa: E402
    extend_attention,
    extend_attention_reference,
)
from braid.kernels.extend_config import (  # noqa: E402
    TUNED_CONFIGS,
    ExtendConfig,
    launch_config,
    tuned_key,
)

CASES = [(1, 0, 4096), (16, 0, 512), (4, 1024, 1024)]
CONFIGS = [
    ExtendConfig(m, n, w, s)
    for m, n, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (1, 2, 3, 4))
    if m % n == 0
]
# BLOCK_M counts tokens: at GROUP 4 a packed tile has 64, 128 or 256 rows.
PACKED_CONFIGS = [
    ExtendConfig(m, n, w, s, pack=1)
    for m, n, w, s in itertools.product((16, 32, 64), (16, 32, 64), (4, 8), (1, 2, 3, 4))
    if m % n == 0
]
SMOKE_CONFIGS = [ExtendConfig(16, 16, 4, 1), ExtendConfig(32, 16, 4, 2)]
SMOKE_PACKED_CONFIGS = [ExtendConfig(16, 16, 4, 1, pack=1)]


def case_inputs(batch, prefix, new, heads, kvh, d, dtype, device):
    """q/k/v of the new tokens and a pool holding every request's prefix, rows end to end."""
    g = torch.Generator().manual_seed(0)
    n = batch * new
    q, k, v = (torch.randn(n, h, d, generator=g).to(dtype).to(device) for h in (heads, kvh, kvh))
    slots = max(1, batch * prefix)
    kc, vc = (torch.randn(slots, kvh, d, generator=g).to(dtype).to(device) for _ in range(2))
    if prefix:
        table = torch.arange(batch * prefix).view(batch, prefix).to(device)
    else:
        table = torch.zeros(batch, 1, dtype=torch.int64, device=device)
    as_idx = dict(dtype=torch.int64, device=device)
    rows = torch.arange(batch, **as_idx)
    pre = torch.full((batch,), prefix, **as_idx)
    ext = torch.full((batch,), new, **as_idx)
    start = torch.arange(batch, **as_idx) * new
    return q, k, v, kc, vc, table, rows, pre, ext, start


def time_s(fn, device, repeats: int, per_repeat: int) -> float:
    for _ in range(3):
        fn()

    def calls():
        for _ in range(per_repeat):
            fn()

    return statistics.median(_elapsed_s(calls, device) for _ in range(repeats)) / per_repeat


def choose(keys: list[tuple[int, ...]], timed: dict) -> tuple[int, ...] | None:
    """Of the configs `keys` (their fields), the one timed in every case whose worst case is
    nearest that case's best among `keys`; None where none was timed in every case."""
    everywhere = [k for k in keys if all(k in by_config for by_config in timed.values())]
    if not everywhere:
        return None
    fastest = {case: min(bc[k]["us"] for k in keys if k in bc) for case, bc in timed.items()}
    return min(everywhere, key=lambda k: max(timed[c][k]["us"] / fastest[c] for c in timed))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, two configs, on CPU")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--per-repeat", type=int, default=10)
    ap.add_argument(
        "--pack",
        choices=("0", "1", "both"),
        default=None,
        help="sweep the unpacked (0) or packed (1) configurations or both (default: both; "
        "0 with --smoke)",
    )
    ap.add_argument("--write-config", action="store_true", help="record the chosen config")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    pack = args.pack or ("0" if args.smoke else "both")
    if args.smoke:
        heads, kvh, d, dtype = 4, 2, 16, torch.float32
        cases, unpacked, packed = [(2, 5, 20)], SMOKE_CONFIGS, SMOKE_PACKED_CONFIGS
        rate = 1.0
    else:
        heads, kvh, d, dtype = 32, 8, 128, torch.bfloat16
        # Packed, only 16 to 32 tile rows per warp: on the H200, 64 rows on 8 warps and 256 on
        # 4 warps ran at 0.05 to 0.17 of the matmul rate in every case (the best, 0.25 to 0.50).
        cases, unpacked = CASES, CONFIGS
        packed = [c for c in PACKED_CONFIGS if 16 <= c.rows(heads // kvh) // c.num_warps <= 32]
        rate = matmul_rate(str(device))["flops_per_s"]
        print(f"bf16 matmul rate {rate / 1e12:.0f} TFLOP/s", flush=True)
    group = heads // kvh
    configs = (unpacked if pack in ("0", "both") else []) + (
        [c for c in packed if c.unfit(group) is None] if pack in ("1", "both") else []
    )
    default = launch_config(d, dtype, device, group, tuned=False)
    rows = []
    for batch, prefix, new in cases:
        inputs = case_inputs(batch, prefix, new, heads, kvh, d, dtype, device)
        scale = d**-0.5
        want = extend_attention(*inputs, scale, max_extend_len=new, config=default)
        # The default config itself against the torch reference, once per case: every config
        # shares the kernel's code, so a fault in it would otherwise agree with itself.
        ref = extend_attention_reference(*inputs, scale).float()
        ref_err = (want.float() - ref).abs().max().item()
        if ref_err > 2e-2:
            raise SystemExit(f"the kernel differs from the reference by {ref_err:.3g}")
        del ref
        visible = batch * heads * (new * prefix + new * (new + 1) // 2)
        flops = 4 * d * visible
        for config in configs:
            row = {"batch": batch, "prefix": prefix, "new": new, "config": config.fields()}
            try:
                got = extend_attention(*inputs, scale, max_extend_len=new, config=config)
                err = (got.float() - want.float()).abs().max().item()
                if err > 2e-2:
                    row["error"] = f"max abs difference {err:.3g} from the default config"
                else:
                    call = partial(
                        extend_attention,
                        *inputs,
                        scale,
                        max_extend_len=new,
                        out=torch.empty_like(got),
                        config=config,
                    )
                    t = time_s(call, device, args.repeats, args.per_repeat)
                    row.update(us=t * 1e6, of_matmul=flops / t / rate)
            except Exception as e:  # a config the GPU cannot run (shared memory, registers)
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            mark = " (default)" if config == default else ""
            shown = (
                f"{row['us']:9.1f} us {row['of_matmul']:6.3f} of matmul"
                if "us" in row
                else row["error"]
            )
            print(
                f"{batch:>3} x ({prefix:>4} + {new:>4}) {config.fields()}{mark}: {shown}",
                flush=True,
            )
    best = {}
    timed = {}
    for r in rows:
        if "us" in r:
            timed.setdefault((r["batch"], r["prefix"], r["new"]), {})[tuple(r["config"])] = r
    for (batch, prefix, new), by_config in timed.items():
        top = min(by_config.values(), key=lambda r: r["us"])
        dflt = by_config.get(tuple(default.fields()))
        best[f"{batch}x({prefix}+{new})"] = {
            "config": top["config"],
            "of_matmul": top["of_matmul"],
            "default_of_matmul": dflt["of_matmul"] if dflt else None,
        }
    by_key = {tuple(c.fields()): c for c in configs}
    chosen = choose(list(by_key), timed)
    unpacked_choice = choose([k for k, c in by_key.items() if not c.pack], timed)
    for name, key in (("chosen", chosen), ("chosen_unpacked", unpacked_choice)):
        if key is not None:
            best[name] = {
                "config": list(key),
                "of_matmul": {
                    f"{b}x({p}+{n})": timed[(b, p, n)][key]["of_matmul"] for b, p, n in timed
                },
            }
    print(best)
    if args.write_config and chosen is not None and device.type == "cuda":
        # The best unpacked config for every GROUP; a packed winner for this sweep's GROUP
        # alone (at another GROUP its tile has other rows), replacing an older one there.
        configs_file = json.loads(TUNED_CONFIGS.read_text()) if TUNED_CONFIGS.is_file() else {}
        entries = configs_file.setdefault(torch.cuda.get_device_name(device), {})
        written = {}
        if unpacked_choice is not None:
            written[tuned_key(d, dtype)] = list(unpacked_choice)
        if by_key[chosen].pack:
            written[tuned_key(d, dtype, group)] = list(chosen)
        else:
            entries.pop(tuned_key(d, dtype, group), None)
        entries.update(written)
        TUNED_CONFIGS.parent.mkdir(parents=True, exist_ok=True)
        TUNED_CONFIGS.write_text(json.dumps(configs_file, indent=2, sort_keys=True) + "\n")
        print(f"wrote {TUNED_CONFIGS}: {written}")
    write_result(
        "tune_extend",
        device.type,
        args.out,
        {
            "heads": [heads, kvh, d],
            "dtype": str(dtype).removeprefix("torch."),
            "matmul_flops_per_s": rate,
            "default": default.fields(),
            "best": best,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
