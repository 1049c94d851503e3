"""The embedded SmolLM2-135M (a Q4_1 GGUF file) on this CPU, in one run: braid float32 (the
file dequantized), braid with the GGUF blocks kept quantized, braid int8 (`w8a16`, quantized
from the dequantized floats), beside transformers (float32, the same dequantized weights) and
llama.cpp (llama-cpp-python, on the same GGUF file). Greedy, fixed lengths (EOS ignored).

    python benchmarks/gguf_cpu.py --llama-cpp-python /tmp/llamacpp-venv/bin/python
    python benchmarks/gguf_cpu.py --tiny-cpu     # the same code on a tiny GGUF written here

llama.cpp is kept out of braid's dependencies: it runs in its own virtual environment, whose
python `--llama-cpp-python` names (without it, llama.cpp is left out). Make it once (about 10
minutes on 2 cores; llama.cpp's native build detects AVX-512 and AMX here and segfaults at
the first decode, hence the flags):

    python3 -m venv /tmp/llamacpp-venv
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \\
        /tmp/llamacpp-venv/bin/pip install llama-cpp-python==0.3.36

Figures, per engine: tokens/s at batch 1 and batch 16 (generated tokens / wall time of the
whole call, prefill included), after one warm-up call, best of `--repeats` rounds; every
engine is loaded at once and each round runs each of them in turn, so a busy moment of the
machine (other work on its 2 cores) falls on all of them alike. braid runs a batch
of 16 prompts as one continuous batch; transformers as one padded-free batch (the prompts
have equal lengths); llama.cpp's Python API runs one sequence at a time, so its batch 16 is
16 sequences in a row. Memory, per braid method: the weight bytes (the tied float32 embedding,
which is also the LM head, included) and the KV tokens that fit in `--memory-gib` with them.
Writes benchmarks/results/gguf_cpu.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import braid  # noqa: E402
from benchmarks.common import write_result  # noqa: E402
from braid.runtime.models.config import ModelConfig  # noqa: E402
from braid.runtime.models.loader import build_model  # noqa: E402
from braid.runtime.models.source import embedded_gguf_path, resolve_model  # noqa: E402

METHODS = ("float32", "gguf", "int8")

# Runs inside llama.cpp's environment: the settings as a JSON line on stdin, then one line per
# measurement ("<batch size>"), answered with the seconds it took; "ready" once loaded.
LLAMA_CPP_SCRIPT = r"""
import json, sys, time
from llama_cpp import Llama
a = json.loads(sys.stdin.readline())
llm = Llama(model_path=a["model"], n_ctx=a["n_ctx"], n_threads=a["threads"],
            n_threads_batch=a["threads"], n_batch=512, verbose=False)

def one(prompt):
    llm.reset()
    n = 0
    for _ in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        n += 1
        if n == a["output_len"]:
            break
    assert n == a["output_len"]

print("ready", flush=True)
for line in sys.stdin:
    bs = int(line)
    t = time.perf_counter()
    for p in a["prompts"][:bs]:
        one(p)
    print(time.perf_counter() - t, flush=True)
"""


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    low = 100 if vocab > 1000 else 5  # skip the special tokens of a real vocabulary
    return [[rng.randrange(low, vocab) for _ in range(length)] for _ in range(n)]


@functools.cache
def model_dir(gguf: Path, floats: bool) -> Path:
    """`gguf` as a model directory, its blocks kept quantized or (`floats`) dequantized; found
    or converted once a run."""
    return resolve_model(gguf, dequantize_gguf=floats)


def engine_args(method: str, gguf: Path) -> tuple[Path, dict]:
    """The directory and settings braid runs `method` with."""
    if method == "gguf":
        return model_dir(gguf, False), {}
    return model_dir(gguf, True), ({"quantization": "w8a16"} if method == "int8" else {})


def memory(method: str, gguf: Path, budget_gib: float) -> dict:
    path, kw = engine_args(method, gguf)
    cfg = ModelConfig.from_dir(path)
    model = build_model(
        cfg,
        path,
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_positions=256,
        progress=False,
        quantization=kw.get("quantization"),
    )
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # float32 K and V
    return {
        "weight_mb": round(weights / 1e6, 1),
        "kv_bytes_per_token": kv_token,
        "kv_tokens_in_budget": max(0, int((budget_gib * 2**30 - weights) // kv_token)),
    }


class BraidEngine:
    def __init__(self, method: str, gguf: Path, prompts, output_len: int) -> None:
        path, kw = engine_args(method, gguf)
        self.llm = braid.LLM(path, kv_tokens=4096, show_progress=False, **kw)
        self.prompts, self.n = prompts, output_len
        self.sp = braid.SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)

    def run(self, bs: int) -> float:
        t = time.perf_counter()
        outs = self.llm.generate(self.prompts[:bs], self.sp, use_tqdm=False)
        dt = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == self.n for o in outs)
        return dt

    def close(self) -> None:
        self.llm.shutdown()


class TransformersEngine:
    """transformers' float32 model of the same file (its own GGUF conversion), in process."""

    def __init__(self, gguf: Path, prompts, output_len: int) -> None:
        from transformers import AutoModelForCausalLM

        path = model_dir(gguf, True)
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        self.prompts, self.n = prompts, output_len

    def run(self, bs: int) -> float:
        x = torch.tensor(self.prompts[:bs])
        t = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=self.n,
                min_new_tokens=self.n,
                do_sample=False,
                pad_token_id=0,
            )
        dt = time.perf_counter() - t
        assert out.shape[1] == x.shape[1] + self.n
        return dt

    def close(self) -> None:
        self.model = None


class LlamaCppEngine:
    """llama-cpp-python in its own environment, a child process answering one line per run."""

    def __init__(self, python: str, gguf: Path, prompts, output_len: int, threads: int) -> None:
        self.proc = subprocess.Popen(
            [python, "-c", LLAMA_CPP_SCRIPT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        settings = {
            "model": str(gguf),
            "n_ctx": 512,
            "threads": threads,
            "prompts": prompts,
            "output_len": output_len,
        }
        self._send(json.dumps(settings))
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"llama.cpp did not start (exit code {self.proc.poll()})")

    def _send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def run(self, bs: int) -> float:
        self._send(str(bs))
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"llama.cpp exited ({self.proc.poll()}) during a run")
        return float(answer)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def measure(engines: dict, batch_sizes: list[int], output_len: int, repeats: int) -> dict:
    """Tokens/s per engine and batch size: every engine warmed up, then `repeats` rounds in
    which each engine runs each batch size in turn (so a busy moment of the machine falls on
    all of them alike); the best round counts."""
    for e in engines.values():
        e.run(1)
    best: dict[str, dict[str, float]] = {name: {} for name in engines}
    for _ in range(repeats):
        for bs in batch_sizes:
            for name, e in engines.items():
                dt = e.run(bs)
                prev = best[name].get(str(bs))
                best[name][str(bs)] = dt if prev is None else min(prev, dt)
    return {
        name: {bs: round(int(bs) * output_len / dt, 1) for bs, dt in times.items()}
        for name, times in best.items()
    }


def tiny_gguf(root: Path) -> Path:
    """A tiny Llama GGUF (Q4_1 linear layers, Q8_0 embedding, as the embedded file), random
    weights, no tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from braid.runtime.quantization.gguf_file import write_llama_gguf

    config = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    state = LlamaForCausalLM(LlamaConfig(**config)).state_dict()
    state.pop("lm_head.weight")
    types = {k: "Q4_1" for k in state if k.endswith("proj.weight")}
    types["model.embed_tokens.weight"] = "Q8_0"
    path = root / "tiny-llama.Q4_1.gguf"
    write_llama_gguf(path, config, state, types)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny-cpu", action="store_true", help="a tiny GGUF written here")
    ap.add_argument("--llama-cpp-python", default=None, help="python of llama.cpp's venv")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    ap.add_argument("--memory-gib", type=float, default=1.0, help="budget for the KV column")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        ap.error(f"unknown methods {sorted(unknown)} (have {', '.join(METHODS)})")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.tiny_cpu:
        args.input_len, args.output_len = min(args.input_len, 8), min(args.output_len, 4)
        args.batch_sizes = [b for b in args.batch_sizes if b <= 4] or [1]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tmp = tempfile.TemporaryDirectory()
    gguf = tiny_gguf(Path(tmp.name)) if args.tiny_cpu else embedded_gguf_path()
    if args.tiny_cpu:
        # The tiny file's converted directories go in the run's own cache; the native CPU
        # decode library stays in the default one (built there once, not 12 s every run).
        with mock.patch.dict(os.environ, BRAID_CACHE_DIR=str(Path(tmp.name) / "cache")):
            for floats in (False, True):
                model_dir(gguf, floats)
    vocab = ModelConfig.from_dir(model_dir(gguf, False)).vocab_size
    prompts = make_prompts(max(args.batch_sizes), args.input_len, vocab)
    rows: dict[str, dict] = {f"braid {m}": memory(m, gguf, args.memory_gib) for m in args.methods}
    engines: dict = {}
    try:
        for m in args.methods:
            engines[f"braid {m}"] = BraidEngine(m, gguf, prompts, args.output_len)
        if not args.no_transformers:
            engines["transformers float32"] = TransformersEngine(gguf, prompts, args.output_len)
        if args.llama_cpp_python:
            engines["llama.cpp"] = LlamaCppEngine(
                args.llama_cpp_python, gguf, prompts, args.output_len, args.threads
            )
        rates = measure(engines, args.batch_sizes, args.output_len, args.repeats)
    finally:
        for e in engines.values():
            e.close()
    for name, r in rates.items():
        rows[name] = {"tokens_per_s": r, **rows.get(name, {})}
    print(f"{'engine':<22}" + "".join(f"{f'batch {b} tok/s':>16}" for b in args.batch_sizes))
    for name, row in rows.items():
        rates = "".join(f"{row['tokens_per_s'][str(b)]:>16.1f}" for b in args.batch_sizes)
        print(f"{name:<22}{rates}")
    result = {
        "model": gguf.name,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "batch_sizes": args.batch_sizes,
        "repeats": args.repeats,
        "threads": args.threads,
        "torch_threads": torch.get_num_threads(),
        "memory_gib": args.memory_gib,
        "engines": rows,
    }
    if "llama.cpp" in rows and "braid gguf" in rows:
        ours, theirs = rows["braid gguf"]["tokens_per_s"], rows["llama.cpp"]["tokens_per_s"]
        result["gguf_vs_llama_cpp"] = {b: round(ours[b] / theirs[b], 2) for b in theirs}
    write_result("gguf", "cpu", args.out, result, script="benchmarks/gguf_cpu.py")
    tmp.cleanup()


if __name__ == "__main__":
    main()
