"""What a grammar costs on the GPU: the same decode with and without a constraint on every step.

    python benchmarks/structured_gpu.py                      # H200: Llama-3.1-8B shapes, bf16
    python benchmarks/structured_gpu.py --tiny-cpu           # the same code at toy size

The model is Llama-3.1-8B's config with random weights (`load_format="dummy"`) and SmolLM2's
tokenizer (its vocabulary sets `vocab_size`), so a grammar compiles against a real BPE
vocabulary. Each request has random prompt tokens and asks for `--output-len` tokens with
`ignore_eos`; the constrained run adds the regex `[a-z0-9 ,.]*`, which masks every step of every
row and forces nothing (no jump-forward), and with `--workloads regex,json` also a JSON schema
of records (`RECORDS`: every step masked, rows in many grammar states, forced keys). Both runs
go through one engine, interleaved, best of `--repeats` each, with fresh prompts every run (the
prefix cache never shortens a prefill); overhead = constrained / free wall time - 1, per
workload and batch size, with the grammar's host time per row (`host_per_row`). The engine's
first request (free)
and the first constrained one after it are timed on their own: the second shows what the
grammar adds to a first request (compile, the mask path's first use).

`--tokenizer DIR`: a directory with SmolLM2's tokenizer files (default: the embedded model's
converted directory, which `braid.runtime.models.source` builds on a machine that has it).
Writes benchmarks/results/structured_gpu_<device>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import braid  # noqa: E402
from benchmarks.common import wait_for_graphs, write_result  # noqa: E402
from benchmarks.offline_throughput import make_prompts  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"
REGEX = "[a-z0-9 ,.]*"
# The JSON-schema workload: records no output of 128 tokens can finish (`minItems`), so every
# step is masked, with rows in many different grammar states (inside keys, strings, numbers,
# between items) and forced text (keys, punctuation) that jump-forward appends.
RECORDS = {
    "type": "array",
    "minItems": 64,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
    },
}
WORKLOADS = {"regex": {"regex": REGEX}, "json": {"json_schema": RECORDS}}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def embedded_tokenizer_dir() -> Path:
    from braid.runtime.models.source import resolve_model

    return resolve_model(None)


def model_dir(config: str, tokenizer: Path, out: Path) -> Path:
    """`config`'s shapes with the tokenizer in `tokenizer` beside them (its vocabulary size,
    BOS and EOS)."""
    from transformers import AutoTokenizer

    cfg = json.loads((CONFIGS / config / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    cfg.update(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, out / name)
    return out


# The scheduler's grammar counters (`GrammarManager.counters`), summed over a batch size's
# constrained runs for `host_per_row`.
HOST_COUNTERS = (
    "grammar_masked_rows",
    "grammar_early_rows",
    "grammar_mask_seconds",
    "grammar_wait_seconds",
    "grammar_advance_seconds",
    "decode_steps",
)


# The scheduler's step counts and its wait for the device to finish each step it reads back,
# per run of each kind (free, constrained): a wait near zero means the host sets the pace.
STEP_COUNTERS = ("decode_steps", "prefill_steps", "readback_wait_seconds")


def host_per_row(c: dict[str, float]) -> dict[str, float]:
    """Microseconds per constrained row: filling its mask (in the mask thread or not),
    advancing its grammar, and the scheduler's thread waiting for the mask thread; and the
    share of rows the mask thread filled."""
    rows = max(c["grammar_masked_rows"], 1.0)
    return {
        "fill_us": 1e6 * c["grammar_mask_seconds"] / rows,
        "advance_us": 1e6 * c["grammar_advance_seconds"] / rows,
        "wait_us": 1e6 * c["grammar_wait_seconds"] / rows,
        "early_share": c["grammar_early_rows"] / rows,
        "decode_steps": c["decode_steps"],
    }


def timed(llm, prompts: list[list[int]], sp: braid.SamplingParams) -> float:
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    lengths = {len(o.outputs[0].token_ids) for o in outs}
    if lengths != {sp.max_tokens}:
        raise RuntimeError(f"asked for {sp.max_tokens} tokens per prompt, got {lengths}")
    return dt


@contextlib.contextmanager
def sampled_stacks(path: Path | None) -> Iterator[None]:
    """Record this process's and its children's Python stacks (py-spy, if on PATH) into `path`,
    as collapsed stacks (one line per stack with its sample count), while the block runs."""
    if path is None or shutil.which("py-spy") is None:
        yield
        return
    argv = ["py-spy", "record", "--pid", str(os.getpid()), "--subprocesses", "--idle"]
    argv += ["--rate", "200", "--format", "raw", "--output", str(path), "--nonblocking"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # py-spy attaches
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if proc.returncode:
            print(f"py-spy exited {proc.returncode}: {err.decode()[-500:]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny-cpu", action="store_true", help="toy model on the CPU")
    ap.add_argument("--tokenizer", type=Path, default=None)
    ap.add_argument("--batch-sizes", default=None, help="default 1,64,256 (tiny: 1,4)")
    ap.add_argument("--input-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--workloads",
        default="regex",
        help="comma-separated: regex (the regex on every row), json (a JSON schema of records)",
    )
    ap.add_argument(
        "--out", default=None, help="result path (default results/structured_gpu_<device>.json)"
    )
    ap.add_argument(
        "--engine-arg", action="append", default=[], help="KEY=VALUE passed to braid.LLM"
    )
    ap.add_argument(
        "--profile-batch",
        type=int,
        default=None,
        help="record py-spy's stacks of the last free and constrained runs at this batch size",
    )
    ap.add_argument("--profile-dir", type=Path, default=Path("."), help="where they go")
    ap.add_argument(
        "--profile-first",
        type=Path,
        default=None,
        help="write py-spy's collapsed stacks of the first constrained request here",
    )
    args = ap.parse_args()
    tiny = args.tiny_cpu
    device = "cpu" if tiny or not torch.cuda.is_available() else "cuda"
    batches = [int(b) for b in (args.batch_sizes or ("1,4" if tiny else "1,64,256")).split(",")]
    n_in = args.input_len or (16 if tiny else 128)
    n_out = args.output_len or (8 if tiny else 128)
    from benchmarks.gpu import parse_engine_args
    from braid.runtime.config import EngineConfig

    engine_args = parse_engine_args(args.engine_arg)
    tokenizer = args.tokenizer or embedded_tokenizer_dir()
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir("tiny-llama" if tiny else "llama-3.1-8b", tokenizer, Path(tmp) / "m")
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        kwargs = dict(
            load_format="dummy",
            dtype="float32" if tiny else "bfloat16",
            device=device,
            show_progress=False,
        )
        kwargs.update(engine_args)
        config = EngineConfig(**kwargs)  # what the engine runs with, for the record
        t0 = time.perf_counter()
        llm = braid.LLM(path, **kwargs)
        load_s = time.perf_counter() - t0
        wait_for_graphs(llm)
        try:
            free = braid.SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
            first = braid.SamplingParams(
                temperature=0.0, max_tokens=20, ignore_eos=True, regex=REGEX
            )
            # The engine's first request pays its own first-use costs (prefill kernels' JIT):
            # a free one goes first, so the constrained one after it shows the grammar's.
            first_free = braid.SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
            first_free_s = timed(llm, make_prompts(1, n_in, vocab, seed=1), first_free)
            with sampled_stacks(args.profile_first):
                first_s = timed(llm, make_prompts(1, n_in, vocab, seed=0), first)
            # The same again: what a constrained request costs once its first-use costs are paid.
            second_s = timed(llm, make_prompts(1, n_in, vocab, seed=5), first)
            rows, seed = [], 2
            cases = [(w, bs) for w in args.workloads.split(",") for bs in batches]
            for workload, bs in tqdm(cases, desc="workloads x batch sizes"):
                masked = braid.SamplingParams(
                    temperature=0.0, max_tokens=n_out, ignore_eos=True, **WORKLOADS[workload]
                )
                runs = {"free": [], "constrained": []}
                host = dict.fromkeys(HOST_COUNTERS, 0.0)
                steps = {f"{n}_{k}": 0.0 for n in ("free", "constrained") for k in STEP_COUNTERS}
                for rep in range(args.repeats):
                    for name, sp in (("free", free), ("constrained", masked)):
                        prompts = make_prompts(bs, n_in, vocab, seed=seed)
                        seed += 1
                        path = None
                        if bs == args.profile_batch and rep == args.repeats - 1:
                            path = args.profile_dir / f"stacks_{name}_{bs}.txt"
                        before = llm.stats()
                        with sampled_stacks(path):
                            runs[name].append(timed(llm, prompts, sp))
                        after = llm.stats()
                        for k in STEP_COUNTERS:
                            steps[f"{name}_{k}"] += after.get(k, 0.0) - before.get(k, 0.0)
                        if name == "constrained":
                            for k in HOST_COUNTERS:
                                host[k] += after.get(k, 0.0) - before.get(k, 0.0)
                best_free, best_masked = min(runs["free"]), min(runs["constrained"])
                rows.append(
                    {
                        "workload": workload,
                        "batch": bs,
                        "free_s": runs["free"],
                        "constrained_s": runs["constrained"],
                        "overhead": best_masked / best_free - 1,
                        "free_tok_s": bs * n_out / best_free,
                        "constrained_tok_s": bs * n_out / best_masked,
                        "grammar_host": host_per_row(host),
                        "steps_per_run": {k: v / args.repeats for k, v in steps.items()},
                        "readback_wait_ms_per_step": {
                            name: 1e3
                            * steps[f"{name}_readback_wait_seconds"]
                            / max(
                                1.0, steps[f"{name}_decode_steps"] + steps[f"{name}_prefill_steps"]
                            )
                            for name in ("free", "constrained")
                        },
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
            stats = llm.stats()
        finally:
            llm.shutdown()
    result = {
        "device": device,
        "model": "tiny-llama" if tiny else "llama-3.1-8b shapes, random weights",
        "tokenizer": str(tokenizer),
        "vocab_size": vocab,
        "regex": REGEX,
        "input_len": n_in,
        "output_len": n_out,
        "engine_args": {k: str(v) for k, v in engine_args.items()},
        "grammar_backend": config.effective_grammar_backend,
        "jump_forward": config.use_jump_forward,
        "grammar_threads": os.environ.get("BRAID_GRAMMAR_THREADS", "default"),
        "load_s": load_s,
        "first_request_s": first_free_s,
        "first_constrained_request_s": first_s,
        "second_constrained_request_s": second_s,
        "rows": rows,
        "constrained_steps_ahead": stats.get("constrained_steps_ahead"),
        "mask_us_per_row": 1e6
        * stats["grammar_mask_seconds"]
        / max(stats["grammar_masked_rows"], 1),
        "decode_steps": stats.get("decode_steps"),
    }
    write_result("structured_gpu", device, args.out, result)
    print(f"first request (20 tokens, free): {first_free_s:.2f} s")
    print(f"first constrained request after it (20 tokens): {first_s:.2f} s")
    print(f"second constrained request (20 tokens): {second_s:.2f} s")
    print(f"bitmask fill: {result['mask_us_per_row']:.1f} us per constrained row")
    for r in rows:
        print(f"{r['workload']:>5} batch {r['batch']:>4}: overhead {100 * r['overhead']:+.1f}%")


if __name__ == "__main__":
    main()
