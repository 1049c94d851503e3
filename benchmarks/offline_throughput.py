"""Offline throughput: braid's `LLM.generate` vs transformers' `generate`, same model, same
prompts, same fixed output lengths (`ignore_eos`), greedy, in one run.

    python benchmarks/offline_throughput.py                      # CPU, embedded SmolLM2, fp32
    python benchmarks/offline_throughput.py --model CONFIG_DIR --load-format dummy --dtype bfloat16

For each batch size B, both engines get the same B prompts of --input-len random tokens and
produce --output-len tokens each; transformers runs them as one padded-free batch of B (all
prompts have the same length). Prints a table and writes JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import braid  # noqa: E402
from benchmarks.common import write_result  # noqa: E402
from braid.runtime.models.source import resolve_model  # noqa: E402


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the low ids, which are special tokens in most vocabularies.
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def braid_dummy_model(cfg, dtype: torch.dtype, device: str):
    """The model braid's scheduler builds with load_format="dummy" (the same seeded draws on
    the same device), built here to hand its weights to the transformers baseline."""
    from braid.runtime.models.loader import build_model

    return build_model(
        cfg,
        None,
        dtype=dtype,
        device=torch.device(device),
        max_positions=8,
        load_format="dummy",
        progress=False,
    )


def copy_braid_weights(ours, cfg, hf) -> None:
    """Give the transformers model braid's (random) weights, unfusing QKV and gate-up."""
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(ours.model.embed_tokens.weight)
        hf.model.norm.weight.copy_(ours.model.norm.weight)
        hf.lm_head.weight.copy_(ours.lm_head.weight)
        for mine, theirs in zip(ours.model.layers, hf.model.layers):
            q, k, v = mine.self_attn.qkv_proj.weight.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
            theirs.self_attn.q_proj.weight.copy_(q)
            theirs.self_attn.k_proj.weight.copy_(k)
            theirs.self_attn.v_proj.weight.copy_(v)
            theirs.self_attn.o_proj.weight.copy_(mine.self_attn.o_proj.weight)
            gate, up = mine.mlp.gate_up_proj.weight.chunk(2)
            theirs.mlp.gate_proj.weight.copy_(gate)
            theirs.mlp.up_proj.weight.copy_(up)
            theirs.mlp.down_proj.weight.copy_(mine.mlp.down_proj.weight)
            theirs.input_layernorm.weight.copy_(mine.input_layernorm.weight)
            theirs.post_attention_layernorm.weight.copy_(mine.post_attention_layernorm.weight)


def run_braid(llm, prompts, output_len: int, device: str) -> tuple[float, list[list[int]]]:
    sp = braid.SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    sync(device)
    dt = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return dt, [o.outputs[0].token_ids for o in outs]


def run_hf(model, prompts, output_len: int, device: str) -> tuple[float, list[list[int]]]:
    x = torch.tensor(prompts, device=device)
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    sync(device)
    dt = time.perf_counter() - t0
    assert out.shape[1] == x.shape[1] + output_len
    return dt, out[:, x.shape[1] :].tolist()


def best_of(fn, repeats: int):
    runs = [fn() for _ in range(repeats)]
    return min(r[0] for r in runs), runs[0][1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="HF dir or .gguf (default: embedded SmolLM2)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per point (best is kept)")
    ap.add_argument("--kv-tokens", type=int, default=None, help="KV capacity (default: sized)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--out", default=None, help="JSON path (default: results/offline_throughput_<device>.json)"
    )
    args = ap.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir = resolve_model(args.model)
    t0 = time.perf_counter()
    llm = braid.LLM(
        model_dir,
        dtype=args.dtype,
        load_format=args.load_format,
        kv_tokens=args.kv_tokens,
        show_progress=False,
    )
    load_s = time.perf_counter() - t0
    vocab = llm.model_config.vocab_size
    torch_dtype = getattr(torch, llm.ready.dtype)

    hf = None
    if not args.skip_hf:
        from transformers import AutoConfig, AutoModelForCausalLM

        if args.load_format == "dummy":
            # Same random weights as braid's, so both should produce the same tokens.
            with torch.device(device):
                hf = AutoModelForCausalLM.from_config(
                    AutoConfig.from_pretrained(model_dir), dtype=torch_dtype
                )
            ours = braid_dummy_model(llm.model_config, torch_dtype, device)
            copy_braid_weights(ours, llm.model_config, hf)
            del ours
        else:
            hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype)
        hf = hf.to(device).eval()

    rows = []
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    warm = make_prompts(2, 8, vocab, seed=0)
    run_braid(llm, warm, 2, device)
    if hf is not None:
        run_hf(hf, warm, 2, device)
    for bs in sizes:
        prompts = make_prompts(bs, args.input_len, vocab, seed=bs)
        tokens = bs * args.output_len
        b, b_ids = best_of(
            lambda p=prompts: run_braid(llm, p, args.output_len, device), args.repeats
        )
        row = {"batch_size": bs, "braid_s": b, "braid_tok_s": tokens / b}
        if hf is not None:
            h, h_ids = best_of(
                lambda p=prompts: run_hf(hf, p, args.output_len, device), args.repeats
            )
            # Fraction of sequences whose greedy tokens are identical (1.0 expected in float32;
            # in 16-bit, rounding differences flip near-ties, more so with random weights).
            same = sum(a == c for a, c in zip(b_ids, h_ids)) / len(prompts)
            row.update(hf_s=h, hf_tok_s=tokens / h, speedup=h / b, same_tokens=same)
        rows.append(row)
        print(json.dumps(row), flush=True)

    print(
        f"\nmodel {model_dir.name} ({torch_dtype}, {device}), "
        f"input {args.input_len}, output {args.output_len}"
    )
    print(f"braid load time: {load_s:.2f} s")
    print(f"{'batch':>5} | {'braid tok/s':>11} | {'transformers tok/s':>18} | {'speedup':>7}")
    for r in rows:
        hf_col = f"{r['hf_tok_s']:18.1f}" if "hf_tok_s" in r else f"{'-':>18}"
        sp = f"{r['speedup']:7.2f}" if "speedup" in r else f"{'-':>7}"
        print(f"{r['batch_size']:>5} | {r['braid_tok_s']:11.1f} | {hf_col} | {sp}")

    write_result(
        "offline_throughput",
        device,
        args.out,
        {
            "model": model_dir.name,
            "dtype": str(torch_dtype),
            "input_len": args.input_len,
            "output_len": args.output_len,
            "braid_load_s": load_s,
            "rows": rows,
        },
    )
    llm.shutdown()


if __name__ == "__main__":
    main()
