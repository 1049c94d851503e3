"""Quantized weights against floats, in one run: weight bytes, each linear kernel's time, batch
decode tokens/s through braid.LLM (each method against its own roofline and against floats) and
one long prefill's model FLOP utilisation.

    python benchmarks/quantization.py             # H200: Llama-3.1-8B shapes, bf16, int4/8, fp8
    python benchmarks/quantization.py --cpu       # here: SmolLM2-135M shapes, float32, int4/8
    python benchmarks/quantization.py --tiny-cpu  # the H200 run's code at toy size on the CPU

Methods: `float` (the model's dtype), `int4` (AWQ layout, group 128; 64 for SmolLM2, whose
hidden size 576 is not a multiple of 128), `int8` (per-channel, compressed-tensors INT8 W8A16
layout), `fp8` (e4m3 per-channel weights, per-token activations). Each engine is braid.LLM with
random weights (`load_format="dummy"`) and a config.json whose `quantization_config` names the
method, so the weights are drawn in floats and quantized as they load (decode speed does not
depend on their values). Before its engine starts, each method's model is built once in this
process for its weight bytes and the per-layer kernel times.

Figures (the machine is measured first, as in benchmarks/gpu.py): the copy rate (bytes read +
written per second), the bf16 matmul rate and, on CUDA, the fp8 `_scaled_mm` rate with row-wise
scales (the call braid makes). A method's roofline is copy rate / the weight bytes one decode
step reads (all weights but the input embedding's table); decode tokens/s are end to end
(prefill included, as gpu.py's) and per decode step. Prefill MFU: model FLOPs of one prompt /
time / the matmul rate of the method's arithmetic (fp8 against the fp8 rate, the others against
bf16's). Targets (issue 18, H200): int4 >= 2.5x and fp8 >= 1.7x bf16's batch-1 decode, fp8
prefill MFU >= 0.55. Writes benchmarks/results/quantization_<cuda|cpu>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import braid  # noqa: E402
from benchmarks.common import _elapsed_s, copy_bandwidth, matmul_rate, write_result  # noqa: E402
from benchmarks.gpu_cost import ModelCost  # noqa: E402
from benchmarks.offline_throughput import make_prompts  # noqa: E402
from braid.runtime.layers.linear import Linear  # noqa: E402
from braid.runtime.models.config import ModelConfig  # noqa: E402
from braid.runtime.models.loader import build_model  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"
TARGETS = {"int4_decode_speedup": 2.5, "fp8_decode_speedup": 1.7, "fp8_prefill_mfu": 0.55}
METHOD_NAMES = ("float", "int4", "int8", "fp8")

PRESETS = {
    "gpu": dict(
        device="cuda",
        dtype="bfloat16",
        model=str(CONFIGS / "llama-3.1-8b"),
        methods="float,int4,int8,fp8",
        group_size=128,
        batch_sizes="1",
        input_len=128,
        output_len=256,
        prompt_len=8192,
        repeats=3,
        kernel_rows="1,16",
        kernel_reps=200,
        rate_size=8192,
    ),
    "cpu": dict(
        device="cpu",
        dtype="float32",
        model=None,  # the embedded SmolLM2
        # fp8 on a CPU runs its torch reference (correct, not fast): left out unless asked.
        methods="float,int4,int8",
        group_size=64,
        batch_sizes="1,16",
        input_len=32,
        output_len=32,
        prompt_len=0,
        repeats=3,
        kernel_rows="1,16",
        kernel_reps=200,
        rate_size=1024,
    ),
    "tiny": dict(
        device="cpu",
        dtype="float32",
        model=str(CONFIGS / "tiny-llama"),
        methods="float,int4,int8,fp8",
        group_size=32,
        batch_sizes="1,2",
        input_len=8,
        output_len=6,
        prompt_len=32,
        repeats=2,
        kernel_rows="1,2",
        kernel_reps=3,
        rate_size=256,
    ),
}


def quantization_config(method: str, group_size: int) -> dict | None:
    """The config.json `quantization_config` a checkpoint of `method` carries."""
    if method == "float":
        return None
    if method == "int4":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
        }
    if method == "int8":
        weights = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}
        return {
            "quant_method": "compressed-tensors",
            "format": "int-quantized",
            "config_groups": {
                "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}
            },
        }
    if method == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic"}
    raise ValueError(f"unknown method {method!r} (have {', '.join(METHOD_NAMES)})")


def method_dir(root: Path, base: Path, method: str, group_size: int) -> Path:
    config = json.loads((base / "config.json").read_text())
    qc = quantization_config(method, group_size)
    if qc is not None:
        config["quantization_config"] = qc
    path = root / method
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


# ---- machine rates ------------------------------------------------------------------------------


def fp8_matmul_rate(device: str, n: int, repeats: int = 10, per_repeat: int = 5) -> dict:
    """`torch._scaled_mm` of two n x n e4m3 matrices with row-wise float32 scales into bf16, in
    FLOP/s (2 n^3 per product), best of `repeats`."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=dev, generator=gen).to(torch.float8_e4m3fn)
    sa = torch.ones(n, 1, device=dev)
    sb = torch.ones(1, n, device=dev)

    def run() -> None:
        for _ in range(per_repeat):
            torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    run()
    times = [_elapsed_s(run, dev) for _ in range(repeats)]
    flops = 2 * n**3 * per_repeat
    return {
        "flops_per_s": flops / min(times),
        "median_flops_per_s": flops / statistics.median(times),
        "n": n,
        "scales": "row-wise",
    }


# ---- one method ---------------------------------------------------------------------------------


def _layer_bytes(layer: Linear) -> int:
    return sum(
        p.numel() * p.element_size()
        for name, p in layer.named_parameters(recurse=False)
        if name != "perm"
    )


def inspect_model(path: Path, args: argparse.Namespace) -> dict:
    """Build the method's model here (random weights): its weight bytes, and each linear
    kernel of the first decoder layer timed at each of `kernel_rows` rows."""
    cfg = ModelConfig.from_dir(path)
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    model = build_model(
        cfg, None, dtype=dtype, device=dev, max_positions=8, load_format="dummy", progress=False
    )
    params = dict(model.named_parameters())
    total = sum(p.numel() * p.element_size() for p in params.values())
    embed = next(p for n, p in params.items() if "embed_tokens" in n)
    tied = cfg.tie_word_embeddings
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear)]
    linear_bytes = sum(_layer_bytes(m) for _, m in layers)
    kernels = []
    for name, layer in layers:
        if not name.startswith("model.layers.0."):
            continue
        row = {"layer": name.removeprefix("model.layers.0."), "bytes": _layer_bytes(layer)}
        for m in (int(r) for r in args.kernel_rows.split(",")):
            x = torch.randn(m, layer.in_features, device=dev, dtype=dtype)
            with torch.inference_mode():
                for _ in range(3):
                    layer(x)

                def run(layer=layer, x=x) -> None:
                    for _ in range(args.kernel_reps):
                        layer(x)

                s = min(_elapsed_s(run, dev) for _ in range(3)) / args.kernel_reps
            row[f"us_m{m}"] = s * 1e6
            # Bytes read per second over the copy rate (bytes read + written per second).
            row[f"fraction_of_copy_rate_m{m}"] = row["bytes"] / s / args.copy_bytes_per_s
        kernels.append(row)
    del model, params, embed
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "weight_bytes": total,
        "linear_weight_bytes": linear_bytes,
        # A decode step reads every weight once, but only its tokens' rows of the embedding.
        "decode_read_bytes": total
        if tied
        else total - cfg.vocab_size * cfg.hidden_size * dtype.itemsize,
        "layer0_kernels": kernels,
    }


def timed_generate(llm: braid.LLM, prompts: list[list[int]], max_tokens: int) -> float:
    sp = braid.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    lengths = {len(o.outputs[0].token_ids) for o in outs}
    if lengths != {max_tokens}:
        raise RuntimeError(f"asked for {max_tokens} tokens per prompt, got lengths {lengths}")
    return dt


def run_engine(path: Path, args: argparse.Namespace, vocab: int) -> dict:
    """Decode at each batch size (fresh prompts every run: no cache hits) and one prefill."""
    batches = [int(b) for b in args.batch_sizes.split(",")]
    n_in, n_out = args.input_len, args.output_len
    ctx = max(args.prompt_len, n_in + n_out) + 16
    engine = dict(
        device=args.device,
        dtype=args.dtype,
        load_format="dummy",
        context_length=ctx,
        max_running_requests=max(batches),
        show_progress=False,
    )
    if args.device == "cpu":
        engine["kv_tokens"] = max(ctx, max(batches) * (n_in + n_out)) + 64
    t0 = time.perf_counter()
    llm = braid.LLM(path, **engine)
    out = {"load_s": time.perf_counter() - t0, "kv_capacity_tokens": llm.ready.kv_capacity_tokens}
    seed = 1
    try:
        out["decode"] = []
        for b in batches:
            timed_generate(llm, make_prompts(b, n_in, vocab, seed=0), n_out)
            full, first = [], []
            for _ in range(args.repeats):
                full.append(timed_generate(llm, make_prompts(b, n_in, vocab, seed=seed), n_out))
                first.append(timed_generate(llm, make_prompts(b, n_in, vocab, seed=seed + 1), 1))
                seed += 2
            steps_s = min(full) - min(first)
            out["decode"].append(
                {
                    "batch_size": b,
                    "full_s": full,
                    "first_token_s": first,
                    "tok_s": b * n_out / min(full),
                    "decode_step_tok_s": b * (n_out - 1) / steps_s
                    if n_out > 1 and steps_s > 0
                    else None,
                }
            )
        if args.prompt_len:
            n = args.prompt_len
            timed_generate(llm, make_prompts(1, n, vocab, seed=10**6), 1)
            times = []
            for _ in range(args.repeats):
                times.append(timed_generate(llm, make_prompts(1, n, vocab, seed=seed), 1))
                seed += 1
            out["prefill"] = {"prompt_len": n, "s": times, "tok_s": n / min(times)}
    finally:
        llm.shutdown()
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return out


# ---- the run ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--cpu", action="store_true", help="this machine: SmolLM2 shapes, float32")
    mode.add_argument("--tiny-cpu", action="store_true", help="the H200 run at toy size, CPU")
    for key in ("model", "dtype", "methods", "batch_sizes", "kernel_rows"):
        ap.add_argument(f"--{key.replace('_', '-')}", default=None)
    for key in (
        "group_size",
        "input_len",
        "output_len",
        "prompt_len",
        "repeats",
        "kernel_reps",
    ):
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=None)
    ap.add_argument("--out", default=None, help="JSON path")
    args = ap.parse_args(argv)
    args.preset = "cpu" if args.cpu else "tiny" if args.tiny_cpu else "gpu"
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    for m in args.methods.split(","):
        quantization_config(m, args.group_size)  # an unknown name fails here, before any work
    return args


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(
            "benchmarks/quantization.py: no CUDA device here. --cpu measures this machine; "
            "--tiny-cpu runs the H200 run's code at toy size."
        )
    if args.model is None:
        from braid.runtime.models.source import resolve_model

        # The embedded model's float config (the GGUF directory's declares its blocks).
        args.model = str(resolve_model(None, dequantize_gguf=True))
    base = Path(args.model)
    cfg = ModelConfig.from_dir(base)
    dtype = getattr(torch, args.dtype)
    small = args.preset == "tiny"
    copy = copy_bandwidth(args.device, 1 << 24, 5) if small else copy_bandwidth(args.device)
    args.copy_bytes_per_s = copy["bytes_per_s"]
    rate = matmul_rate(args.device, args.rate_size, torch.bfloat16, 3 if small else 10)
    rates = {"float": rate["flops_per_s"]}
    fp8_rate = None
    if "fp8" in args.methods.split(",") and args.device == "cuda":
        fp8_rate = fp8_matmul_rate(args.device, args.rate_size)
        rates["fp8"] = fp8_rate["flops_per_s"]
    elif "fp8" in args.methods.split(","):
        fp8_rate = fp8_matmul_rate(args.device, args.rate_size, repeats=3, per_repeat=2)
        rates["fp8"] = fp8_rate["flops_per_s"]
    cost = ModelCost.of(cfg, dtype)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for method in tqdm(args.methods.split(","), desc="methods"):
            path = method_dir(Path(tmp), base, method, args.group_size)
            res = inspect_model(path, args)
            res.update(run_engine(path, args, cfg.vocab_size))
            res["roofline_tok_s"] = args.copy_bytes_per_s / res["decode_read_bytes"]
            for row in res["decode"]:
                row["fraction_of_roofline"] = row["tok_s"] / (
                    row["batch_size"] * res["roofline_tok_s"]
                )
            if "prefill" in res:
                flops = cost.forward_flops(args.prompt_len)
                against = rates.get(method, rates["float"])
                res["prefill"].update(
                    flops=flops,
                    mfu=flops / min(res["prefill"]["s"]) / against,
                    mfu_against=("fp8" if method == "fp8" else "bf16") + " matmul rate",
                )
            results[method] = res
            print(json.dumps({method: {k: res[k] for k in ("weight_bytes", "roofline_tok_s")}}))
    if "float" in results:
        base_rows = {r["batch_size"]: r for r in results["float"]["decode"]}
        for res in results.values():
            for row in res["decode"]:
                row["vs_float"] = row["tok_s"] / base_rows[row["batch_size"]]["tok_s"]
            res["weight_bytes_vs_float"] = res["weight_bytes"] / results["float"]["weight_bytes"]
    table = []
    for method, res in results.items():
        for row in res["decode"]:
            gb = res["weight_bytes"] / 1e9
            # A run without the float method has nothing to compare with in the same run.
            ratio = f"{row['vs_float']:.2f}x float" if "vs_float" in row else "no float run"
            table.append(
                f"{method:6s} b={row['batch_size']:<3d} weights {gb:7.3f} GB "
                f"decode {row['tok_s']:9.1f} tok/s ({row['fraction_of_roofline']:.2f} of "
                f"roofline, {ratio})"
            )
        if "prefill" in res:
            p = res["prefill"]
            table.append(f"{method:6s} prefill {p['tok_s']:9.0f} tok/s, MFU {p['mfu']:.3f}")
    checks = {}
    one = {
        m: next((r for r in res["decode"] if r["batch_size"] == 1), None)
        for m, res in results.items()
    }
    for method, key in (("int4", "int4_decode_speedup"), ("fp8", "fp8_decode_speedup")):
        if one.get(method) and "vs_float" in one[method]:
            checks[key] = {"value": one[method]["vs_float"], "target": TARGETS[key]}
    if "fp8" in results and "prefill" in results["fp8"]:
        checks["fp8_prefill_mfu"] = {
            "value": results["fp8"]["prefill"]["mfu"],
            "target": TARGETS["fp8_prefill_mfu"],
        }
    for c in checks.values():
        c["meets_target"] = c["value"] >= c["target"]
    print("\n".join(table))
    print(json.dumps(checks, indent=1))
    write_result(
        "quantization",
        args.device,
        args.out,
        {
            "preset": args.preset,
            "model": base.name,
            "dtype": args.dtype,
            "sizes": {k: getattr(args, k) for k in PRESETS["gpu"] if k not in ("device", "model")},
            "copy_bandwidth": copy,
            "matmul": rate,
            "fp8_matmul": fp8_rate,
            "methods": results,
            "targets": checks,
            "table": table,
            "notes": "tok_s: end to end (prefill included), best of repeats; decode_step_tok_s: "
            "(output_len - 1) steps / (best full time - best 1-token time); roofline_tok_s: "
            "copy bytes/s (read + written) / decode_read_bytes (all weights but the input "
            "embedding); fraction_of_roofline per sequence; vs_float: tok_s / float's at the "
            "same batch size, same run",
        },
    )


if __name__ == "__main__":
    main()
