"""A decode forward of the embedded SmolLM2 on this CPU, in process: the model and
the torch-native backend over a paged KV pool, no scheduler, no other process. What the
forward itself costs, apart from the engine's host work (`gguf_cpu.py` times the whole
engine beside llama.cpp).

    python benchmarks/cpu_step.py                  # the file's blocks kept quantized
    python benchmarks/cpu_step.py --method float32 # the file dequantized
    python benchmarks/cpu_step.py --layers python  # each layer's Python forward, not the
                                                   # native decode

Each round times `--steps` forwards of one token for each of `--batch` sequences at
`--context` tokens of context (their KV slots shuffled, as a pool's are after some churn;
`--slots run`: each sequence one ascending run, as a fresh pool gives a request, which the
Python attention of a lone sequence reads in place); the figure is the best round's mean.
Writes benchmarks/results/cpu_step_cpu.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_result  # noqa: E402
from benchmarks.gguf_cpu import engine_args  # noqa: E402
from braid.runtime.attention.torch_native import TorchNativeBackend  # noqa: E402
from braid.runtime.cache.memory_pool import KVPool, ReqToTokenPool  # noqa: E402
from braid.runtime.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from braid.runtime.models.config import ModelConfig  # noqa: E402
from braid.runtime.models.loader import build_model  # noqa: E402
from braid.runtime.models.source import embedded_gguf_path  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="gguf", choices=("gguf", "float32", "int8"))
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--slots",
        default="shuffled",
        choices=("shuffled", "run"),
        help="the sequence's KV slots: shuffled (a pool after churn: gathered) or one "
        "ascending run (a fresh pool's: read in place)",
    )
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded per forward")
    ap.add_argument(
        "--layers",
        default="native",
        choices=("native", "python"),
        help="the decoder layers as one native call where the model allows it (the runtime's "
        "default), or each layer's Python forward",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    cpu = torch.device("cpu")
    path, kw = engine_args(args.method, embedded_gguf_path())
    cfg = ModelConfig.from_dir(path)
    model = build_model(
        cfg, path, dtype=torch.float32, device=cpu, max_positions=args.context + 1,
        progress=False, quantization=kw.get("quantization"),
    )  # fmt: skip
    if args.layers == "python":
        model.model.native_decode = None
    b, n = args.batch, args.context
    slots = 4 * n * b
    pool = KVPool(cfg.num_layers, slots + 1, 1, cfg.num_kv_heads, cfg.head_dim, torch.float32, cpu)
    table = ReqToTokenPool(b, n, cpu)
    if args.slots == "run":
        table.table[:] = torch.arange(1, b * n + 1).view(b, n)
    else:
        perm = torch.randperm(slots, generator=torch.Generator().manual_seed(0))
        table.table[:] = (perm[: b * n] + 1).view(b, n)
    attn = TorchNativeBackend(pool, table, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)

    def forward() -> None:
        batch = ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=torch.full((b,), 123),
            positions=torch.full((b,), n - 1),
            out_cache_loc=table.table[:, n - 1].clone(),
            req_pool_indices=torch.arange(b),
            seq_lens=torch.full((b,), n),
            prefix_lens=[n - 1] * b,
            extend_lens=[1] * b,
            logits_indices=torch.arange(b),
        )
        attn.init_forward_metadata(batch)
        model(batch, attn)

    rounds = []
    with torch.inference_mode():
        for _ in range(5):
            forward()
        for _ in range(args.rounds):
            t = time.perf_counter()
            for _ in range(args.steps):
                forward()
            rounds.append((time.perf_counter() - t) / args.steps * 1e3)
    best = min(rounds)
    print(
        f"{args.method}, {'native' if model.model.native_decode else 'python'} layers, "
        f"batch {b}: {best:.2f} ms a forward "
        f"(rounds: {', '.join(f'{r:.2f}' for r in rounds)})"
    )
    write_result(
        "cpu_step",
        "cpu",
        args.out,
        {
            "method": args.method,
            "slots": args.slots,
            "layers": args.layers,
            "native_decode": model.model.native_decode is not None,
            "batch": b,
            "context": args.context,
            "steps": args.steps,
            "torch_threads": torch.get_num_threads(),
            "forward_ms": round(best, 3),
            "rounds_ms": [round(r, 3) for r in rounds],
        },
    )


if __name__ == "__main__":
    main()
