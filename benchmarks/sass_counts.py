"""Instructions a kernel's inner loop issues on an H100/H200 (sm_90), counted on any machine,
no GPU needed: each kernel is compiled by `triton.compile` for `GPUTarget("cuda", 90, 32)` with
the pointer and size arguments marked 16-divisible (as Triton specializes them at run time),
disassembled by the `cuobjdump` in Triton's wheel, and the largest loop's instructions counted.

    python benchmarks/sass_counts.py                   # the int4 GEMVs and decode attention
    python benchmarks/sass_counts.py --kernels int4    # one family
    python benchmarks/sass_counts.py --kernels pdl     # where PDL's wait and trigger sit

Per thread, one loop trip; `per_weight` = loop instructions x threads / weights a trip reads
(GEMVs), `per_key` = the same per key and KV head (decode attention). Also the registers and
local-memory spills of the whole kernel. The `pdl` family instead checks the order of the
kernels built for programmatic dependent launch (`braid/kernels/pdl.py`): in the int4 GEMVs
the L2 prefetches (CCTL.PF2) come before the wait (ACQBULK) and no global load, store or
atomic before it, no branch jumps past it; in the kernels that trigger (PREEXIT), the trigger
comes before their first load. The counts depend on Triton's version (the GPU
machine's is 3.6.0): the JSON records it. Writes benchmarks/results/sass_counts_<version>.json.

What a count is for: at the copy rate an H200 streams about 8.5e12 int4 weights a second and
issues about 3.4e13 thread instructions (132 SMs x 4 schedulers x 32 lanes x 1.98 GHz), so a
GEMV that issues more than about 4 instructions per weight cannot read at the copy rate.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results"

_INSTR = re.compile(
    r"\s+/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)(\.[A-Z0-9_.]+)?\s*([^;]*);"
)


def _build_sm90(fn, signature: dict, constexprs: dict, divisible: list[str], warps: int, stages=1):
    """`fn` compiled for sm_90 (`.asm` holds its PTX and cubin), `divisible` arguments marked
    16-divisible."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": warps, "num_stages": stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_sm90(fn, signature: dict, constexprs: dict, divisible: list[str], warps: int, stages=1):
    """(SASS text, registers, spill stores) of `fn` compiled for sm_90."""
    return disassemble(_build_sm90(fn, signature, constexprs, divisible, warps, stages))


def compile_all(jobs: list[tuple]) -> list[tuple[str, int | None, int]]:
    """`compile_sm90(*job)` of each job, in order: built one after another (Triton's compiler
    is not for threads), disassembled two at a time (cuobjdump, a few tenths of a second a
    kernel, runs outside the GIL)."""
    kernels = [_build_sm90(*job) for job in jobs]
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(disassemble, kernels))


def disassemble(kernel) -> tuple[str, int | None, int]:
    """(SASS text, registers, spill stores) of a kernel `_build_sm90` built."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    return sass, int(regs.group(1)) if regs else None, sass.count(" STL")


def loop_counts(sass: str) -> collections.Counter:
    """Opcode counts of the largest loop (the longest backward branch)."""
    lines = [(int(m.group(1), 16), m.group(3), m.group(5)) for m in _INSTR.finditer(sass)]
    best = None
    for addr, op, args in lines:
        target = re.search(r"0x([0-9a-f]+)", args) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            if best is None or addr - lo > best[1] - best[0]:
                best = (lo, addr)
    if best is None:
        return collections.Counter()
    return collections.Counter(op for addr, op, _ in lines if best[0] <= addr <= best[1])


def _row(name: str, sass: str, regs, spills, per: str, amount: float, threads: int) -> dict:
    counts = loop_counts(sass)
    total = sum(counts.values())
    row = {
        "kernel": name,
        "loop_instructions": total,
        per: round(total * threads / amount, 2),
        "registers": regs,
        "spill_stores": spills,
        "top": counts.most_common(10),
    }
    print(f"{name:44s} {per} {row[per]:7.2f}  loop {total:5d}  regs {regs}  spills {spills}")
    return row


# GemvConfig fields (block_n, block_k, split_k, warps, stages): the H200 tables' and sweeps'.
INT4_FLOAT32 = [(256, 128, 8, 4, 3), (64, 256, 4, 2, 2)]
INT4_PACKED = [(512, 128, 8, 4, 2), (256, 128, 8, 4, 3), (1024, 128, 8, 8, 2)]
# The packed form's prologues (`int4_gemv`'s activation and norm_weight) at its first config.
PROLOGUES = [{"ACT": True}, {"NORM": True, "HAS_RESIDUAL": True, "NORM_BLOCK": 4096}]


_INT4_POINTERS = {"X": "*bf16", "Q": "*i32", "Meta": "*i32", "Bias": "*bf16", "Out": "*bf16"}
_INT4_POINTERS |= {"Partials": "*fp32", "Counters": "*i32"}
_INT4_POINTERS |= {"NormW": "*bf16", "Residual": "*bf16", "ResidualOut": "*bf16"}
_INT4_POINTERS |= {"XP": "*i32", "XG": "*fp32"}


# Scalar arguments passed as float32; every other non-pointer, non-constexpr one is an int32.
_FLOATS = ("eps", "min_scale", "scale_log2", "v_scale")


def _signature(fn, pointers: dict, values: dict) -> tuple[dict, dict]:
    """(signature, constexprs) of the @triton.jit `fn`: `pointers` by type, `values` as
    constexprs, floats by name, the rest int32."""
    sig, consts = {}, {}
    for p in inspect.signature(fn.fn).parameters:
        if p in pointers:
            sig[p] = pointers[p]
        elif p in values:
            sig[p], consts[p] = "constexpr", values[p]
        else:
            sig[p] = "fp32" if p in _FLOATS else "i32"
    return sig, consts


def _int4_signature(fn, values: dict) -> tuple[dict, dict, list[str]]:
    """(signature, constexprs, 16-divisible arguments) of an int4 GEMV kernel: the pointers
    and the sizes (not the magic constant)."""
    sig, consts = _signature(fn, _INT4_POINTERS, values)
    div = [p for p, t in sig.items() if t not in ("constexpr", "fp32") and p != "magic"]
    return sig, consts, div


def int4_rows() -> list[dict]:
    from braid.kernels.int4_gemv import _int4_gemv_f16x2_kernel, _int4_gemv_kernel

    plain = {"ACT": False, "NORM": False, "HAS_RESIDUAL": False, "NORM_BLOCK": 1}
    cases = [(_int4_gemv_kernel, c, {}, "int4 float32") for c in INT4_FLOAT32]
    cases += [(_int4_gemv_f16x2_kernel, c, plain, "int4 f16x2") for c in INT4_PACKED]
    zero_last = plain | {"ZERO_LAST": True}
    cases += [(_int4_gemv_f16x2_kernel, c, zero_last, "int4 f16x2 zero-last") for c in INT4_PACKED]
    for extra in PROLOGUES:
        label = "int4 f16x2 " + ("silu_and_mul" if extra.get("ACT") else "rmsnorm+residual")
        cases.append((_int4_gemv_f16x2_kernel, INT4_PACKED[0], plain | extra, label))
    # The inputs packed ahead (`int4_pairs.pack_int4_inputs`): loaded as words, not made.
    ahead = zero_last | {"X_PACKED": True}
    label = "int4 f16x2 zero-last, inputs packed ahead"
    cases += [(_int4_gemv_f16x2_kernel, c, ahead, label) for c in INT4_PACKED]
    rows = []
    for fn, (bn, bk, split, warps, stages), extra, name in cases:
        values = {"GROUP": 128, "BLOCK_N": bn, "SUBS": bk // 128, "SPLIT_K": split}
        values |= {"EVEN_N": True, "EVEN_K": True, "HAS_BIAS": False, "STAGES": stages}
        values |= {
            "PTX": True,
            "PDL": False,
            "PREFETCH_LINES": 1,
            "SPLITS_FIRST": False,
            "ZERO_LAST": False,
            "X_PACKED": False,
        } | extra
        sig, consts, div = _int4_signature(fn, values)
        sass, regs, spills = compile_sm90(fn, sig, consts, div, warps)
        label = f"{name} {bn}x{bk} split {split} w{warps} s{stages}"
        rows.append(_row(label, sass, regs, spills, "per_weight", bn * bk, 32 * warps))
    return rows


# (cache dtype, block_n, warps, stages, fp8 mode): bf16 and the fp8 modes at the tuned configs.
DECODE = [("*bf16", 64, 4, 3, 0), ("*fp8e4nv", 128, 4, 4, 1), ("*fp8e4nv", 128, 4, 4, 2)]


def _decode_args(cache: str, block_n: int, mode: int, evict: str) -> tuple[dict, dict, list]:
    """(signature, constexprs, 16-divisible arguments) of `_decode_stage1` over a `cache`
    ("*bf16" or "*fp8e4nv") KV cache at Llama-3.1-8B's head shapes."""
    from braid.kernels.attention_decode import _decode_stage1

    pointers = {"Q": "*bf16", "KCache": cache, "VCache": cache, "ReqToToken": "*i32"}
    pointers |= {"ReqIdx": "*i64", "SeqLens": "*i64", "Prefix": "*i64", "Tail": "*i64"}
    pointers |= {"MidO": "*fp32", "MidLse": "*fp32"}
    values = {"GROUP": 4, "BLOCK_H": 16, "H_BLOCKS": 1, "HEAD_DIM": 128, "BLOCK_D": 128}
    values |= {"BLOCK_N": block_n, "NUM_SPLITS": 8, "USE_WINDOW": False, "HAS_TAIL": False}
    values |= {"DOT_PREC": "tf32", "KV_FP8": cache != "*bf16", "FP8_AS_F16": mode > 0}
    values |= {"FP8_WORDS": mode == 2, "PTX": True, "EVICT": evict}
    sig, consts = _signature(_decode_stage1, pointers, values)
    return sig, consts, [*pointers, *(p for p in sig if p.startswith("stride"))]


def decode_ptx(evict: str) -> str:
    """The PTX of the bf16 decode kernel with its K/V loads' eviction policy `evict`."""
    from braid.kernels.attention_decode import _decode_stage1

    sig, consts, div = _decode_args("*bf16", 64, 0, evict)
    return _build_sm90(_decode_stage1, sig, consts, div, 4, 3).asm["ptx"]


def decode_rows() -> list[dict]:
    from braid.kernels.attention_decode import _decode_stage1

    rows = []
    for cache, block_n, warps, stages, mode in DECODE:
        sig, consts, div = _decode_args(cache, block_n, mode, "")
        sass, regs, spills = compile_sm90(_decode_stage1, sig, consts, div, warps, stages)
        label = f"decode {cache.strip('*')} mode {mode} block {block_n} w{warps} s{stages}"
        rows.append(_row(label, sass, regs, spills, "per_key", block_n, 32 * warps))
    return rows


# Opcodes that read or write global memory: what a kernel launched with PDL may not run before
# its wait.
GLOBAL_OPS = {"LDG", "LDGSTS", "STG", "ATOM", "ATOMG", "RED", "LD", "ST", "LDGDEPBAR"}


def pdl_order(sass: str) -> dict:
    """Where the PDL instructions sit in program order: the wait (ACQBULK), the trigger
    (PREEXIT), the L2 prefetches (CCTL) and the global memory operations before the wait,
    branches that jump over the wait, and the first global operation's index."""
    lines = [(int(m.group(1), 16), m.group(3), m.group(5)) for m in _INSTR.finditer(sass)]
    ops = [op for _, op, _ in lines]
    waits = [i for i, op in enumerate(ops) if op == "ACQBULK"]
    triggers = [i for i, op in enumerate(ops) if op == "PREEXIT"]
    wait = waits[0] if waits else len(ops)
    memory = [i for i, op in enumerate(ops) if op in GLOBAL_OPS]
    jumps = 0
    if waits:
        for _, op, args in lines[:wait]:
            target = re.search(r"0x([0-9a-f]+)", args) if op.startswith("BRA") else None
            jumps += bool(target and int(target.group(1), 16) > lines[wait][0])
    return {
        "waits": len(waits),
        "wait_at": waits[0] if waits else None,
        "triggers": len(triggers),
        "trigger_at": triggers[0] if triggers else None,
        "prefetches_before_wait": sum(op == "CCTL" for op in ops[:wait]) if waits else 0,
        "memory_before_wait": [ops[i] for i in memory if i < wait] if waits else [],
        "branches_past_wait": jumps,
        "first_memory_at": memory[0] if memory else None,
    }


def pdl_rows() -> list[dict]:
    """The int4 GEMVs built with PDL and without, and the kernels that trigger."""
    from braid.kernels.activation import _silu_and_mul_kernel
    from braid.kernels.attention_decode import _decode_stage2
    from braid.kernels.int4_gemv import _int4_gemv_f16x2_kernel, _int4_gemv_kernel
    from braid.kernels.norm import _rmsnorm_kernel
    from braid.kernels.quant_gemv import _fp8_gemv_kernel, _int8_gemv_kernel

    jobs: list[tuple[str, tuple]] = []  # (row label, compile_sm90's arguments)
    plain = {"ACT": False, "NORM": False, "HAS_RESIDUAL": False, "NORM_BLOCK": 1}
    norm = {"ACT": False, "NORM": True, "HAS_RESIDUAL": True, "NORM_BLOCK": 4096}
    gemvs = [
        (_int4_gemv_kernel, {}, "int4 float32"),
        (_int4_gemv_f16x2_kernel, plain, "int4 f16x2"),
    ]
    gemvs.append((_int4_gemv_f16x2_kernel, norm, "int4 f16x2 rmsnorm+residual"))
    for fn, extra, name in gemvs:
        for on in (True, False):
            values = {"GROUP": 128, "BLOCK_N": 256, "SUBS": 1, "SPLIT_K": 8, "EVEN_N": True}
            values |= {"EVEN_K": True, "HAS_BIAS": False, "STAGES": 3, "PTX": True}
            values |= {"PDL": on, "PREFETCH_LINES": 2, "SPLITS_FIRST": False, "ZERO_LAST": False}
            values |= {"X_PACKED": False}
            values |= extra
            jobs.append((f"{name} pdl={on}", (fn, *_int4_signature(fn, values), 4)))
    bf16 = "*bf16"
    byte_pointers = {"X": bf16, "Scales": "*fp32", "Bias": bf16, "Out": bf16}
    byte_pointers |= {"Partials": "*fp32", "Counters": "*i32"}
    for fn, weight, extra, name in (
        (_fp8_gemv_kernel, "*fp8e4nv", {"X_BLOCK": 4096, "DOT": True, "X_AHEAD": False}, "fp8 dot"),
        (_fp8_gemv_kernel, "*fp8e4nv", {"X_BLOCK": 4096, "DOT": False, "X_AHEAD": False}, "fp8"),
        (_int8_gemv_kernel, "*i8", {}, "int8"),
    ):
        for on in (True, False):
            pointers = byte_pointers | {"W": weight}
            values = {"BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 4, "HAS_BIAS": False}
            values |= {"STAGES": 3, "PDL": on, "PREFETCH_LINES": 4, "SPLITS_FIRST": False}
            values |= extra
            sig, consts = _signature(fn, pointers, values)
            jobs.append((f"{name} pdl={on}", (fn, sig, consts, [*pointers, "K", "SPLIT_LEN"], 4)))
    from braid.kernels.skinny_gemm import _skinny_gemm_kernel

    skinny_pointers = {"X": bf16, "W": bf16, "Bias": bf16, "Out": bf16, "NormW": bf16}
    skinny_pointers |= {"Residual": bf16, "ResidualOut": bf16}
    for one_row, name in ((True, "skinny rmsnorm+residual"), (False, "skinny")):
        for on in (True, False):
            values = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 256, "EVEN_K": True}
            values |= {"HAS_BIAS": False, "DOT_PREC": "tf32", "ACTIVATION": None}
            values |= {"ONE_ROW": one_row, "NORM": one_row, "HAS_RESIDUAL": one_row}
            values |= {"NORM_BLOCK": 4096 if one_row else 1, "PDL": on}
            sig, consts = _signature(_skinny_gemm_kernel, skinny_pointers, values)
            div = [*skinny_pointers, "K", "stride_wn"]
            jobs.append((f"{name} pdl={on}", (_skinny_gemm_kernel, sig, consts, div, 4)))
    norm_pointers = {"X": bf16, "Residual": bf16, "W": bf16, "Out": bf16, "NewResidual": bf16}
    triggers = [
        (_rmsnorm_kernel, norm_pointers,
         {"N": 4096, "BLOCK": 4096, "HAS_RESIDUAL": True}, 16, "rmsnorm"),
        (_silu_and_mul_kernel, {"X": bf16, "Out": bf16}, {"D": 14336, "BLOCK": 1024}, 4,
         "silu_and_mul"),
        (_decode_stage2, {"MidO": "*fp32", "MidLse": "*fp32", "O": bf16},
         {"HEAD_DIM": 128, "BLOCK_D": 128, "NUM_SPLITS": 8, "BLOCK_S": 8}, 4, "decode_stage2"),
    ]  # fmt: skip
    for fn, pointers, values, warps, name in triggers:
        sig, consts = _signature(fn, pointers, values | {"TRIGGER": True})
        jobs.append((f"{name} trigger=True", (fn, sig, consts, list(pointers), warps)))
    built = compile_all([job for _, job in jobs])
    rows = [{"kernel": label} | pdl_order(sass) for (label, _), (sass, _, _) in zip(jobs, built)]
    for row in rows:
        print(json.dumps(row))
    return rows


# (block_n, block_k, split_k, dot): fp8 one-row GEMVs of the sweeps, on the CUDA cores and the
# tensor cores.
FP8 = [(16, 512, 1, False), (64, 256, 4, False), (64, 256, 4, True), (128, 256, 2, True)]


def fp8_rows() -> list[dict]:
    """The fp8 GEMV with x quantized in every program and over codes made ahead (X_AHEAD):
    the loop's instructions a weight, and the whole kernel's (the row's max |x| pass before
    the loop is outside the loop)."""
    from braid.kernels.quant_gemv import _fp8_gemv_kernel

    bf16 = "*bf16"
    pointers = {"X": bf16, "W": "*fp8e4nv", "Scales": "*fp32", "Bias": bf16, "Out": bf16}
    pointers |= {"Partials": "*fp32", "Counters": "*i32", "XQ": "*fp8e4nv", "XS": "*fp32"}
    jobs, cases = [], []
    for bn, bk, split, dot in FP8:
        for ahead in (False, True):
            values = {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "HAS_BIAS": False}
            values |= {"STAGES": 3, "PDL": False, "PREFETCH_LINES": 1, "SPLITS_FIRST": False}
            values |= {"X_BLOCK": 4096, "DOT": dot, "X_AHEAD": ahead}
            sig, consts = _signature(_fp8_gemv_kernel, pointers, values)
            jobs.append((_fp8_gemv_kernel, sig, consts, [*pointers, "K", "SPLIT_LEN"], 4, 3))
            cases.append((f"fp8{' dot' if dot else ''}{' codes ahead' if ahead else ''}", bn, bk))
    rows = []
    for (label, bn, bk), (sass, regs, spills) in zip(cases, compile_all(jobs)):
        row = _row(f"{label} {bn}x{bk}", sass, regs, spills, "per_weight", bn * bk, 128)
        row["kernel_instructions"] = len(_INSTR.findall(sass))
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--kernels", default="int4,decode", help="comma-separated: int4, decode, pdl, fp8"
    )
    ap.add_argument("--out", default=None, help="JSON path")
    args = ap.parse_args(argv)
    import triton

    families = {"int4": int4_rows, "decode": decode_rows, "pdl": pdl_rows, "fp8": fp8_rows}
    rows = [row for name in args.kernels.split(",") for row in families[name]()]
    out = Path(args.out or RESULTS / f"sass_counts_triton{triton.__version__}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"triton": triton.__version__, "target": "sm_90", "rows": rows}
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
