"""braid's GPU figures: Llama-3.1-8B shapes with random bf16 weights, one subcommand per figure.

    python benchmarks/gpu.py decode    # batch-1 decode tokens/s vs the bandwidth roofline
    python benchmarks/gpu.py prefill   # one 8k-token prompt: tokens/s and model FLOP utilisation
    python benchmarks/gpu.py offline   # 1024 prompts, 512 in / 256 out: vs transformers, vs a bound
    python benchmarks/gpu.py prefix    # prefix-sharing workloads, radix cache on vs off
    python benchmarks/gpu.py decode --tiny-cpu   # the same code paths at toy size on the CPU

Every run first measures the machine it runs on: the device-to-device copy rate (bytes read +
written per second, best of 20 copies of a 1 GiB tensor, CUDA events) and the bf16 matmul rate
(8192^3 torch.matmul, best of 10); the roofline, utilisation and bound figures divide by these.
braid builds its weights with load_format="dummy"; transformers (the reference) builds the same
config with random init in the same dtype on the same device, after braid's engine has shut
down, so the two never share GPU memory. Model construction is never timed.

Engine settings pass through to `braid.LLM` with `--engine-arg KEY=VALUE` (repeatable; the value
is parsed by the EngineConfig field's type), e.g. `--engine-arg max_running_requests=512`;
`--attention-backend NAME` is a shortcut. Writes benchmarks/results/gpu_<figure>_<device>.json.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import braid  # noqa: E402
from benchmarks.common import copy_bandwidth, matmul_rate, wait_for_graphs, write_result  # noqa: E402
from benchmarks.gpu_cost import ModelCost, offline_bound  # noqa: E402
from benchmarks.gpu_prefix import WordTokenizer, workload_chat_ids  # noqa: E402
from benchmarks.offline_throughput import make_prompts, run_hf  # noqa: E402
from benchmarks.prefix_sharing import (  # noqa: E402
    measure,
    run_batch,
    workload_hellaswag,
    workload_mmlu,
)
from braid.runtime.config import EngineConfig  # noqa: E402
from braid.runtime.models.config import ModelConfig  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"
# Issue 21's targets: batch-1 decode at 0.89 of the roofline, 8k prefill at MFU 0.75, offline
# at 0.80 of the bound; "offline" (the first GPU issue's): 10x transformers' best batch.
TARGETS = {"decode": 0.89, "prefill": 0.75, "offline": 10.0, "offline_bound": 0.80}

# Sizes of each figure: the H200 run, and the toy run that proves the code paths on a CPU.
SIZES = {
    "gpu": dict(
        repeats=3,
        decode_input_len=128,
        decode_output_len=256,
        prompt_len=8192,
        num_prompts=1024,
        input_len=512,
        output_len=256,
        # Up to where transformers stops gaining (or runs out of memory): its best batch.
        hf_batch_sizes="64,128,256,512",
        scale=16,
    ),
    "tiny": dict(
        repeats=2,
        decode_input_len=16,
        decode_output_len=8,
        prompt_len=256,
        num_prompts=8,
        input_len=16,
        output_len=8,
        hf_batch_sizes="2,4",
        scale=1,
    ),
}


@dataclass(frozen=True)
class Run:
    """What every figure gets: the model, how to start engines, and the machine's rates."""

    model_dir: Path
    model_name: str
    model_config: ModelConfig
    device: str
    dtype: str
    engine_args: dict[str, object]
    copy_bytes_per_s: float  # bytes read + written per second
    matmul_flops_per_s: float
    cost: ModelCost


# ---- engine and reference helpers -------------------------------------------------------------


def parse_engine_args(pairs: list[str]) -> dict[str, object]:
    """`KEY=VALUE` strings to `braid.LLM` keyword arguments, each value parsed by the type of
    its EngineConfig field ("none" gives None where the field allows it). An argument
    `braid.LLM` does not take raises ValueError naming the ones it does."""
    params = inspect.signature(braid.LLM).parameters
    types = {f.name: str(f.type) for f in fields(EngineConfig)}
    accepted = [n for n, p in params.items() if n != "model" and p.kind != p.VAR_KEYWORD]
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        # braid.LLM(**kwargs) forwards to EngineConfig: its fields are the arguments.
        accepted += [n for n in types if n not in accepted and n != "model"]
    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ValueError(f"--engine-arg must be KEY=VALUE, got {pair!r}")
        if key not in accepted:
            raise ValueError(
                f"--engine-arg {key}: braid.LLM takes no such argument "
                f"(it takes {', '.join(accepted)})"
            )
        out[key] = _parse_value(key, raw.strip(), types.get(key, "str"))
    return out


def _parse_value(key: str, raw: str, typ: str) -> object:
    low = raw.lower()
    if "None" in typ and low in ("none", "null"):
        return None
    if "bool" in typ:
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"--engine-arg {key}: expected true or false, got {raw!r}")
    try:
        if "int" in typ:
            return int(raw)
        if "float" in typ:
            return float(raw)
    except ValueError:
        raise ValueError(f"--engine-arg {key}: expected {typ}, got {raw!r}") from None
    return raw


def start_engine(run: Run, **overrides: object) -> tuple[braid.LLM, dict]:
    """A braid engine with dummy weights, and what it reported about itself."""
    kwargs = {"dtype": run.dtype, "load_format": "dummy", **run.engine_args, **overrides}
    t0 = time.perf_counter()
    llm = braid.LLM(run.model_dir, **kwargs)
    info = {
        "load_s": time.perf_counter() - t0,
        "graphs_wait_s": wait_for_graphs(llm),
        "kv_capacity_tokens": llm.ready.kv_capacity_tokens,
        "max_running_requests": llm.ready.max_running_requests,
        "context_length": llm.ready.context_length,
        "dtype": llm.ready.dtype,
        "phases_s": dict(llm.ready.phases),  # start-up phases: weights, graphs, ...
    }
    print(f"braid engine ready: {json.dumps(info)}", flush=True)
    return llm, info


def timed_generate(
    llm: braid.LLM, prompts: list[list[int]], max_tokens: int, *, use_tqdm: bool = False
) -> tuple[float, list]:
    """Wall seconds of one greedy `generate` of exactly `max_tokens` per prompt, and outputs.
    The engine runs in its own processes and answers only when done: no sync is needed."""
    sp = braid.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=use_tqdm)
    dt = time.perf_counter() - t0
    lengths = {len(o.outputs[0].token_ids) for o in outs}
    if lengths != {max_tokens}:
        raise RuntimeError(f"asked for {max_tokens} tokens per prompt, got lengths {lengths}")
    return dt, outs


def hf_model(run: Run):
    """transformers' model for the same config, random init, in the run's dtype and device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(run.model_dir)
    with torch.device(run.device):
        model = AutoModelForCausalLM.from_config(
            cfg, dtype=getattr(torch, run.dtype), attn_implementation="sdpa"
        )
    return model.eval()


def stop_engine(run: Run, llm: braid.LLM, timeout_s: float = 30.0) -> None:
    """Shut the engine down and, on a GPU, wait until its memory is back: the next engine
    sizes its KV pool from free memory, and transformers needs room too."""
    llm.shutdown()
    if run.device != "cuda":
        return
    deadline = time.monotonic() + timeout_s
    while True:
        free, total = torch.cuda.mem_get_info()
        if free >= 0.8 * total:
            return
        if time.monotonic() > deadline:
            print(f"warning: {free / 1e9:.1f} of {total / 1e9:.1f} GB free after shutdown")
            return
        time.sleep(0.2)


def release_memory(run: Run) -> None:
    gc.collect()
    if run.device == "cuda":
        torch.cuda.empty_cache()


# ---- figures ----------------------------------------------------------------------------------


def fig_decode(run: Run, args: argparse.Namespace) -> tuple[dict, list[tuple[str, str]]]:
    """Batch-1 greedy decode through braid.LLM vs the bandwidth roofline (every weight byte read
    once per token at the measured copy rate, as the device README computes it)."""
    llm, engine = start_engine(run)
    try:
        res, table = measure_decode(llm, engine, run, args)
    finally:
        stop_engine(run, llm)
    if not args.skip_hf:
        n_in, n_out = args.input_len, args.output_len
        hf = hf_model(run)
        prompts = make_prompts(1, n_in, run.model_config.vocab_size, seed=0)
        run_hf(hf, prompts, 2, run.device)
        hf_s, _ = run_hf(hf, prompts, n_out, run.device)
        del hf
        release_memory(run)
        res.update(hf_s=hf_s, hf_tok_s=n_out / hf_s)
        table.append(("transformers tok/s", f"{n_out / hf_s:.1f}"))
    return res, table


def measure_decode(
    llm: braid.LLM, engine: dict, run: Run, args: argparse.Namespace
) -> tuple[dict, list[tuple[str, str]]]:
    """`fig_decode`'s braid figures on a started engine."""
    n_in, n_out = args.input_len, args.output_len
    vocab = run.model_config.vocab_size
    timed_generate(llm, make_prompts(1, n_in, vocab, seed=0), n_out)
    full, first = [], []
    # Fresh prompts every run, so the radix cache never shortens a prefill.
    for r in tqdm(range(args.repeats), desc="braid decode runs"):
        full.append(timed_generate(llm, make_prompts(1, n_in, vocab, seed=1 + 2 * r), n_out)[0])
        first.append(timed_generate(llm, make_prompts(1, n_in, vocab, seed=2 + 2 * r), 1)[0])
    roofline = run.copy_bytes_per_s / run.cost.weight_bytes
    tok_s = n_out / min(full)
    steps_s = min(full) - min(first)
    decode_tok_s = (n_out - 1) / steps_s if n_out > 1 and steps_s > 0 else None
    res = {
        "input_len": n_in,
        "output_len": n_out,
        "engine": engine,
        "braid_s": full,
        "braid_first_token_s": first,
        "braid_tok_s": tok_s,
        "braid_decode_tok_s": decode_tok_s,
        "roofline_tok_s": roofline,
        "roofline_tok_s_excluding_embedding": run.copy_bytes_per_s
        / (run.cost.weight_bytes - run.cost.embedding_bytes),
        "fraction_of_roofline": tok_s / roofline,
        "decode_fraction_of_roofline": decode_tok_s / roofline if decode_tok_s else None,
        "target_fraction": TARGETS["decode"],
        "meets_target": tok_s / roofline >= TARGETS["decode"],
        "notes": "braid_tok_s = output_len / best end-to-end time (prefill included); "
        "braid_decode_tok_s = (output_len - 1) / (best full time - best 1-token time); "
        "roofline_tok_s = copy bytes/s (read + written) / weight_bytes",
    }
    table = [
        ("braid tok/s (end to end)", f"{tok_s:.1f}"),
        ("braid decode-step tok/s", f"{decode_tok_s:.1f}" if decode_tok_s else "-"),
        ("roofline tok/s", f"{roofline:.1f}"),
        ("fraction of roofline", f"{tok_s / roofline:.3f} (target {TARGETS['decode']})"),
    ]
    return res, table


def fig_prefill(run: Run, args: argparse.Namespace) -> tuple[dict, list[tuple[str, str]]]:
    """One long prompt, one output token: tokens/s and model FLOP utilisation against the
    measured matmul rate. The time includes the round trip through braid's processes."""
    llm, engine = start_engine(run)
    try:
        return measure_prefill(llm, engine, run, args)
    finally:
        stop_engine(run, llm)


def measure_prefill(
    llm: braid.LLM, engine: dict, run: Run, args: argparse.Namespace
) -> tuple[dict, list[tuple[str, str]]]:
    """`fig_prefill` on a started engine."""
    n = args.prompt_len
    vocab = run.model_config.vocab_size
    if n >= llm.context_length:
        raise ValueError(f"--prompt-len {n} must be below the context length {llm.context_length}")
    timed_generate(llm, make_prompts(1, n, vocab, seed=0), 1)
    times = [
        timed_generate(llm, make_prompts(1, n, vocab, seed=1 + r), 1)[0]
        for r in tqdm(range(args.repeats), desc="braid prefill runs")
    ]
    flops = run.cost.forward_flops(n)
    mfu = flops / min(times) / run.matmul_flops_per_s
    res = {
        "prompt_len": n,
        "engine": engine,
        "braid_s": times,
        "braid_tok_s": n / min(times),
        "flops": flops,
        "flops_formula": "2 * layer_matmul_params * tokens + 2 * lm_head_params (one logits row)"
        " + 4 * layers * heads * head_dim * tokens * (tokens + 1) / 2",
        "layer_matmul_params": run.cost.layer_matmul_params,
        "mfu": mfu,
        "median_mfu": flops / statistics.median(times) / run.matmul_flops_per_s,
        "target_mfu": TARGETS["prefill"],
        "meets_target": mfu >= TARGETS["prefill"],
    }
    table = [
        ("prompt tokens", str(n)),
        ("braid best s", f"{min(times):.4f}"),
        ("braid tok/s", f"{n / min(times):.0f}"),
        ("model TFLOP", f"{flops / 1e12:.1f}"),
        ("MFU", f"{mfu:.3f} (target {TARGETS['prefill']})"),
    ]
    return res, table


def fig_offline(run: Run, args: argparse.Namespace) -> tuple[dict, list[tuple[str, str]]]:
    """Many prompts at once through braid.LLM vs transformers' generate at its best batch."""
    llm, engine = start_engine(run)
    try:
        res, table = measure_offline(llm, engine, run, args)
    finally:
        stop_engine(run, llm)
    tokens = args.num_prompts * args.output_len
    vocab = run.model_config.vocab_size
    braid_s = res["braid_s"]
    if not args.skip_hf:
        hf_rows = run_hf_batches(run, args, vocab)
        ok = [r for r in hf_rows if "tok_s" in r]
        res["hf_rows"] = hf_rows
        res["hf_note"] = (
            "transformers ran one batch of each size (input_len in, output_len out, after a "
            "2-token warm-up of that batch); its time for all prompts is extrapolated as "
            "ceil(num_prompts / B) batches of the best size"
        )
        if ok:
            best = max(ok, key=lambda r: r["tok_s"])
            hf_tok_s = tokens / best["est_total_s"]
            ratio = (tokens / braid_s) / hf_tok_s
            res.update(
                hf_best_batch_size=best["batch_size"],
                hf_tok_s=hf_tok_s,
                speedup=ratio,
                target_speedup=TARGETS["offline"],
                meets_target=ratio >= TARGETS["offline"],
            )
            table += [
                (f"transformers tok/s (batch {best['batch_size']})", f"{hf_tok_s:.0f}"),
                ("speedup", f"{ratio:.2f}x (target {TARGETS['offline']}x)"),
            ]
    return res, table


def measure_offline(
    llm: braid.LLM, engine: dict, run: Run, args: argparse.Namespace
) -> tuple[dict, list[tuple[str, str]]]:
    """`fig_offline`'s braid figures on a started engine, against the bound of `run.cost`."""
    n, n_in, n_out = args.num_prompts, args.input_len, args.output_len
    vocab = run.model_config.vocab_size
    # The warm-up runs a full batch, so full-batch kernels are compiled before timing.
    warm = min(n, engine["max_running_requests"])
    timed_generate(llm, make_prompts(warm, n_in, vocab, seed=10**6), min(n_out, 8))
    before = llm.stats()
    braid_s, _ = timed_generate(llm, make_prompts(n, n_in, vocab, seed=1), n_out, use_tqdm=True)
    after = llm.stats()
    engine["steps"] = {
        k: after[k] - before[k] for k in ("prefill_steps", "decode_steps", "retractions")
    }
    tokens = n * n_out
    batch = max(
        1,
        min(n, engine["max_running_requests"], engine["kv_capacity_tokens"] // (n_in + n_out)),
    )
    bound = offline_bound(
        run.cost, n, n_in, n_out, batch, run.copy_bytes_per_s, run.matmul_flops_per_s
    )
    res = {
        "num_prompts": n,
        "input_len": n_in,
        "output_len": n_out,
        "engine": engine,
        "braid_s": braid_s,
        "braid_tok_s": tokens / braid_s,
        "bound": bound,
        "bound_tok_s": tokens / bound["bound_s"],
        "fraction_of_bound": bound["bound_s"] / braid_s,
        "target_fraction_of_bound": TARGETS["offline_bound"],
        "meets_bound_target": bound["bound_s"] / braid_s >= TARGETS["offline_bound"],
    }
    table = [
        ("braid output tok/s", f"{tokens / braid_s:.0f}"),
        ("bound tok/s", f"{tokens / bound['bound_s']:.0f}"),
        (
            "fraction of bound",
            f"{bound['bound_s'] / braid_s:.3f} (target {TARGETS['offline_bound']})",
        ),
    ]
    return res, table


def run_hf_batches(run: Run, args: argparse.Namespace, vocab: int) -> list[dict]:
    hf = hf_model(run)
    rows = []
    for b in tqdm([int(x) for x in args.hf_batch_sizes.split(",")], desc="transformers batches"):
        prompts = make_prompts(b, args.input_len, vocab, seed=b)
        s = None
        try:
            run_hf(hf, prompts, 2, run.device)
            s, _ = run_hf(hf, prompts, args.output_len, run.device)
        except torch.OutOfMemoryError:
            pass
        if s is None:
            # Outside the except block: its traceback no longer holds the batch's tensors.
            rows.append({"batch_size": b, "error": "out of memory"})
            release_memory(run)
            continue
        rows.append(
            {
                "batch_size": b,
                "s": s,
                "tok_s": b * args.output_len / s,
                "est_total_s": math.ceil(args.num_prompts / b) * s,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    del hf
    release_memory(run)
    return rows


def fig_prefix(run: Run, args: argparse.Namespace) -> tuple[dict, list[tuple[str, str]]]:
    """benchmarks/prefix_sharing.py's workloads at this model's scale, with the radix cache and
    without; the two engines run one after the other (two 8B engines would share the GPU)."""
    tok = WordTokenizer(run.model_config.vocab_size)
    s = args.scale
    workloads: dict[str, Callable[[braid.LLM], list]] = {
        "mmlu_5shot": lambda llm: workload_mmlu(llm, tok, 1, 32 * s),
        "hellaswag_20shot": lambda llm: workload_hellaswag(llm, tok, 2, 6 * s),
        "multi_turn_chat": lambda llm: workload_chat_ids(llm, tok, 3, 8 * s),
    }
    res: dict[str, dict] = {}
    engines = {}
    for key, overrides in (("cache", {}), ("no_cache", {"disable_radix_cache": True})):
        llm, engines[key] = start_engine(run, **overrides)
        try:
            run_batch(llm, make_prompts(8, 256, run.model_config.vocab_size, seed=99), 4)
            res[key] = {
                name: measure(llm, lambda llm=llm, fn=fn: fn(llm))
                for name, fn in tqdm(workloads.items(), desc=f"workloads ({key})")
            }
        finally:
            stop_engine(run, llm)
    rows = []
    for name in workloads:
        c, nc = res["cache"][name], res["no_cache"][name]
        co, nco = c.pop("outputs"), nc.pop("outputs")
        rows.append(
            {
                "workload": name,
                "cache": c,
                "no_cache": nc,
                "speedup": nc["wall_s"] / c["wall_s"],
                "prefill_reduction": nc["prefill_tokens_computed"]
                / max(1, c["prefill_tokens_computed"]),
                # 16-bit numerics differ between batch shapes: a fraction, not a promise.
                "same_outputs_fraction": sum(a == b for a, b in zip(co, nco)) / len(co),
            }
        )
    table = [
        (
            r["workload"],
            f"{r['cache']['requests']} reqs: {r['no_cache']['wall_s']:.2f} s -> "
            f"{r['cache']['wall_s']:.2f} s ({r['speedup']:.2f}x), prefill tokens "
            f"{r['no_cache']['prefill_tokens_computed']} -> {r['cache']['prefill_tokens_computed']}"
            f", hit rate {r['cache']['hit_rate']:.3f} (best {r['cache']['best_hit_rate']:.3f})",
        )
        for r in rows
    ]
    return {"scale": s, "engines": engines, "tokenizer": "word-level hash", "rows": rows}, table


FIGURES = {
    "decode": fig_decode,
    "prefill": fig_prefill,
    "offline": fig_offline,
    "prefix": fig_prefix,
}


# ---- command line -----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--tiny-cpu",
        action="store_true",
        help="toy run on the CPU (tiny-llama config, float32, small sizes): proves the code runs",
    )
    common.add_argument("--model", default=None, help="config dir (default: llama-3.1-8b)")
    common.add_argument("--dtype", default=None, help="default: bfloat16 (float32 with --tiny-cpu)")
    common.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a braid.LLM / EngineConfig argument, repeatable",
    )
    common.add_argument("--attention-backend", default=None, help="shortcut for the engine arg")
    common.add_argument("--repeats", type=int, default=None, help="timed runs (best is kept)")
    common.add_argument("--skip-hf", action="store_true", help="no transformers reference")
    common.add_argument("--out", default=None, help="JSON path")

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="figure", required=True)
    p = sub.add_parser("decode", parents=[common], help=fig_decode.__doc__)
    p.add_argument("--input-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p = sub.add_parser("prefill", parents=[common], help=fig_prefill.__doc__)
    p.add_argument("--prompt-len", type=int, default=None)
    p = sub.add_parser("offline", parents=[common], help=fig_offline.__doc__)
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--input-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--hf-batch-sizes", default=None, help="comma-separated")
    p = sub.add_parser("prefix", parents=[common], help=fig_prefix.__doc__)
    p.add_argument("--scale", type=int, default=None, help="multiply the number of requests")
    args = ap.parse_args(argv)

    sizes = dict(SIZES["tiny" if args.tiny_cpu else "gpu"])
    if args.figure == "decode":
        sizes["input_len"] = sizes.pop("decode_input_len")
        sizes["output_len"] = sizes.pop("decode_output_len")
    for key, value in sizes.items():
        if getattr(args, key, "absent") is None:
            setattr(args, key, value)
    try:
        args.engine_args = parse_engine_args(args.engine_arg)
    except ValueError as e:
        ap.error(str(e))
    if args.attention_backend is not None:
        args.engine_args["attention_backend"] = args.attention_backend
    return args


def tiny_model_dir(tmp: str) -> Path:
    """tiny-llama's config with room for prefix_sharing's 20-shot prompts (~700 tokens)."""
    cfg = json.loads((CONFIGS / "tiny-llama" / "config.json").read_text())
    cfg["max_position_embeddings"] = 4096
    path = Path(tmp) / "tiny-llama"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def make_run(
    model_dir: Path,
    model_name: str,
    cfg: ModelConfig,
    device: str,
    dtype: str,
    engine_args: dict[str, object],
    rates: tuple[dict, dict],
    tp: int = 1,
) -> Run:
    """The `Run` of `model_dir` on a device measured at `rates` (`measure_rates`), its costs
    one of `tp` tensor-parallel ranks' (the whole model's at 1)."""
    copy, mm = rates
    return Run(
        model_dir=model_dir,
        model_name=model_name,
        model_config=cfg,
        device=device,
        dtype=dtype,
        engine_args=engine_args,
        copy_bytes_per_s=copy["bytes_per_s"],
        matmul_flops_per_s=mm["flops_per_s"],
        cost=ModelCost.of(cfg, getattr(torch, dtype), tp),
    )


def measure_rates(device: str, dtype: torch.dtype, tiny: bool) -> tuple[dict, dict]:
    if tiny:
        return copy_bandwidth(device, 1 << 24, 5), matmul_rate(device, 256, dtype, 3, 2)
    return copy_bandwidth(device), matmul_rate(device, 8192, dtype)


def main() -> None:
    args = parse_args()
    if not args.tiny_cpu and not torch.cuda.is_available():
        sys.exit(
            "benchmarks/gpu.py: no CUDA device here (torch.cuda.is_available() is False). "
            "These figures are measured on a GPU; --tiny-cpu runs the same code at toy size on "
            "the CPU."
        )
    device = "cpu" if args.tiny_cpu else "cuda"
    engine_args = dict(args.engine_args)
    dtype = str(
        engine_args.pop("dtype", None) or args.dtype or ("float32" if args.tiny_cpu else "bfloat16")
    )
    engine_args.setdefault("device", device)
    if args.tiny_cpu:
        # The CPU default sizes the KV pool from RAM: gigabytes nobody uses at toy size.
        engine_args.setdefault("kv_tokens", 16384)
    if dtype not in ("bfloat16", "float16", "float32"):
        sys.exit(f"benchmarks/gpu.py: dtype must be bfloat16, float16 or float32, got {dtype!r}")
    torch_dtype = getattr(torch, dtype)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model_dir = Path(args.model)
        elif args.tiny_cpu:
            model_dir = tiny_model_dir(tmp)
        else:
            model_dir = CONFIGS / "llama-3.1-8b"
        cfg = ModelConfig.from_dir(model_dir)
        print(f"measuring {device} copy bandwidth and {dtype} matmul rate", flush=True)
        copy, mm = measure_rates(device, torch_dtype, args.tiny_cpu)
        print(
            f"copy {copy['bytes_per_s'] / 1e12:.3f} TB/s (read + written), "
            f"matmul {mm['flops_per_s'] / 1e12:.1f} TFLOP/s",
            flush=True,
        )
        name = "tiny-llama" if args.tiny_cpu and not args.model else model_dir.name
        run = make_run(model_dir, name, cfg, device, dtype, engine_args, (copy, mm))
        res, table = FIGURES[args.figure](run, args)

    print(f"\n{args.figure}: {run.model_name} ({dtype}, {device}), engine args {engine_args}")
    rows = [
        ("copy bandwidth (read + written)", f"{run.copy_bytes_per_s / 1e12:.4g} TB/s"),
        (f"{dtype} matmul rate", f"{run.matmul_flops_per_s / 1e12:.4g} TFLOP/s"),
        *table,
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:>{width}} | {v}")
    write_result(
        f"gpu_{args.figure}",
        device,
        args.out,
        {
            "model": run.model_name,
            "dtype": dtype,
            "engine_args": engine_args,
            "copy_bandwidth": copy,
            "matmul": mm,
            "weight_bytes": run.cost.weight_bytes,
            **res,
        },
        script="benchmarks/gpu.py",
    )


if __name__ == "__main__":
    main()
