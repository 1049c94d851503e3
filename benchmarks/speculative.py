"""Speculative decoding: what a verify step costs, and what n-gram drafts buy at batch 1.

    python benchmarks/speculative.py                 # H200: Llama-3.1-8B shapes, random bf16
    python benchmarks/speculative.py --tiny-cpu      # the same code at toy size
    python benchmarks/speculative.py --smollm2       # CPU, the embedded model's real weights

Three figures, each in one run:
- `verify`: in process (no front end), `Scheduler.step()` with k = 2, 4, 8 draft tokens a
  request against a decode step, at each batch size; the drafts are made up (mostly rejected),
  so every step gains about one token: the ratio is what verifying k drafts costs, and
  (k + 1) x decode / verify the most a step of k drafts could gain.
- `ngram`: batch 1, greedy, in process, without speculation (the overlapped decode) and with
  n-gram drafts of 4 and 8 tokens, on two workloads of the same random model. As drawn
  (N(0, 0.02)), its greedy output does not repeat (measured: no period, about one draft found
  in a hundred steps). Made to loop (`make_it_loop`: the layers' writes to the residual
  stream scaled by 1e-3 and the LM head set to the embedding, so the model repeats its last
  token), every n-gram draft is right: the speed when drafts are right, with the same kernels
  and shapes. The run reports each workload's output period and whether the tokens are the
  ones decoding without drafts gives.
- `smollm2` (CPU): the embedded model on copy-heavy prompts ("repeat this passage", "fix one
  word in this code"), batch 1 and 4, with and without n-gram speculation.
Writes benchmarks/results/speculative_<device>.json (or `--out`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import braid  # noqa: E402
from benchmarks.common import wait_for_graphs, write_result  # noqa: E402
from benchmarks.offline_throughput import make_prompts  # noqa: E402
from braid.runtime.config import EngineConfig  # noqa: E402
from braid.runtime.ipc.to_scheduler import AbortReq, GenerateReq  # noqa: E402
from braid.runtime.scheduler.process import build_scheduler  # noqa: E402
from braid.runtime.speculative.base import Proposer  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"


class MadeUpDrafts(Proposer):
    """k drafts a request, all the request's last token (a model rarely repeats it)."""

    name = "MADE_UP"

    def __init__(self, k: int) -> None:
        self.k = k

    @classmethod
    def from_config(cls, config, target):
        raise NotImplementedError

    def propose(self, reqs: Sequence, limits: Sequence[int]) -> list[list[int]]:
        return [[r.output_ids[-1]] * min(self.k, n) for r, n in zip(reqs, limits)]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def verify_cost(
    model_dir: Path, batches: list[int], ks: list[int], context: int, steps: int, device: str
) -> list[dict]:
    """Per batch size: ms per `Scheduler.step()` for plain decode (overlapped and not) and for
    verify steps of k made-up drafts a request."""
    most = max(batches)
    dtype = "bfloat16" if device == "cuda" else "float32"
    config = EngineConfig(
        model=str(model_dir),
        load_format="dummy",
        dtype=dtype,
        device=device,
        kv_tokens=most * (context + steps * (max(ks) + 2) + 64) + 4096,
        max_running_requests=max(8, most),
        cuda_graph_max_bs=max(8, min(512, most * (max(ks) + 1))),
        speculative_algorithm="NGRAM",
        speculative_num_steps=max(ks),
        show_progress=False,
    )
    sched = build_scheduler(config, model_dir, frozenset())
    drafter = sched.decode.drafter
    vocab = sched.vocab_size
    rows = []
    for b in tqdm(batches, desc="verify cost"):
        row = {"batch": b}
        modes = [("decode_overlap", None), ("decode", 0)] + [(f"verify_k{k}", k) for k in ks]
        for name, k in modes:
            sp = braid.SamplingParams(
                temperature=0.0, max_tokens=steps * (max(ks) + 1) + 32, ignore_eos=True
            )
            for i in range(b):
                prompt = [(7 + 131 * i + 17 * j) % vocab for j in range(context)]
                sched.handle(GenerateReq(f"r{i}", prompt, sp, i))
            if k is None:  # plain decode, overlapped: the path without speculation
                sched.decode.drafter, sched.overlap = None, device == "cuda"
            else:
                sched.decode.drafter, sched.overlap = drafter, False
                drafter.proposer = sched.proposer = MadeUpDrafts(k)
            while len(sched.running) < b:
                sched.step()
            for _ in range(5):
                sched.step()
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                sched.step()
            _sync(device)
            row[f"{name}_ms"] = (time.perf_counter() - t0) / steps * 1e3
            for i in range(b):
                sched.handle(AbortReq(f"r{i}"))
            while sched.has_work:
                sched.step()
        for k in ks:
            row[f"verify_k{k}_over_decode"] = row[f"verify_k{k}_ms"] / row["decode_ms"]
            row[f"ceiling_k{k}"] = (k + 1) * row["decode_overlap_ms"] / row[f"verify_k{k}_ms"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    sched.decode.drafter = drafter
    return rows


def _period(tokens: list[int]) -> int | None:
    """The shortest period of the last half of `tokens`, if it repeats at all."""
    tail = tokens[len(tokens) // 2 :]
    for p in range(1, len(tail) // 2 + 1):
        if all(tail[i] == tail[i - p] for i in range(p, len(tail))):
            return p
    return None


def make_it_loop(model) -> None:
    """Make the random model's greedy output repeat its last token: the layers' writes to the
    residual stream are scaled down (so it stays the current token's embedding) and the LM head
    is the embedding (so that token scores highest). In place: CUDA graphs stay valid."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(1e-3)
            layer.mlp.down_proj.weight.mul_(1e-3)
        if model.lm_head.weight is not model.model.embed_tokens.weight:
            model.lm_head.weight.copy_(model.model.embed_tokens.weight)


def ngram_speed(
    model_dir: Path, n_in: int, n_out: int, steps_list: list[int], device: str, repeats: int
) -> dict:
    """Batch-1 greedy tokens/s in process, without speculation (overlapped decode) and with
    n-gram drafts of each length, on the random model as it is and on the same model made to
    loop (`make_it_loop`); the tokens must be the same with and without drafts."""
    dtype = "bfloat16" if device == "cuda" else "float32"
    config = EngineConfig(
        model=str(model_dir),
        load_format="dummy",
        dtype=dtype,
        device=device,
        kv_tokens=8 * (n_in + n_out + 64) + 4096,
        max_running_requests=8,
        speculative_algorithm="NGRAM",
        speculative_num_steps=max(steps_list),
        show_progress=False,
    )
    sched = build_scheduler(config, model_dir, frozenset())
    drafter = sched.decode.drafter
    vocab = sched.vocab_size
    out: dict = {"input_len": n_in, "output_len": n_out}
    for workload in ("random", "looping"):
        if workload == "looping":
            make_it_loop(sched.runner.model)
        runs, baseline = [], None
        for steps in [0, *steps_list]:
            if steps == 0:
                sched.decode.drafter, sched.overlap = None, device == "cuda"
            else:
                sched.decode.drafter, sched.overlap = drafter, False
                drafter.steps = steps
            times, tokens, stats = [], None, {}
            for r in range(repeats + 1):  # the first is a warm-up
                prompt = make_prompts(1, n_in, vocab, seed=3)[0]
                sp = braid.SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
                before = dict(sched.stats.as_dict())
                _sync(device)
                t0 = time.perf_counter()
                sched.handle(GenerateReq(f"{workload}-{steps}-{r}", prompt, sp, 0))
                got: list[int] = []
                while sched.has_work:
                    for o in sched.step():
                        got += o.new_token_ids
                _sync(device)
                if r:
                    times.append(time.perf_counter() - t0)
                tokens = got
                after = sched.stats.as_dict()
                stats = {k: after[k] - before[k] for k in after if k.startswith("spec_")}
                sched.flush_cache()  # the next run prefills again
            if baseline is None:
                baseline = tokens
            req_steps = stats.get("spec_request_steps", 0)
            run = {
                "num_steps": steps,
                "seconds": times,
                "tok_s": n_out / min(times),
                "same_tokens": tokens == baseline,
                "first_difference": next(
                    (i for i, (a, b) in enumerate(zip(tokens, baseline)) if a != b), None
                ),
                "accept_length": stats.get("spec_emitted_tokens", 0) / req_steps
                if req_steps
                else None,
                "drafts": stats.get("spec_draft_tokens", 0),
                "accepted": stats.get("spec_accepted_tokens", 0),
            }
            runs.append(run)
            print(json.dumps({"workload": workload, **run}), flush=True)
        for run in runs[1:]:
            run["speedup"] = run["tok_s"] / runs[0]["tok_s"]
        out[workload] = {"period": _period(baseline), "runs": runs}
    sched.decode.drafter = drafter
    return out


PASSAGE = (
    "The old lighthouse stood at the edge of the cliff for nearly two hundred years. Every "
    "night its keeper climbed the spiral stairs, trimmed the wick and wound the clockwork "
    "that turned the great lens, so that ships far out at sea could find their way home."
)
CODE = (
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(vaules)\n\n\ndef spread(values):\n    m = mean(values)\n"
    "    return max(values) - min(values), m\n"
)
TASKS = {
    "repeat": "Repeat the following passage exactly, word for word:\n\n" + PASSAGE,
    "fix": "Fix the typo in this code and output the whole corrected code:\n\n" + CODE,
}


def smollm2_speed(n_out: int, batches: list[int], steps: int, repeats: int) -> dict:
    """The embedded model on CPU, copy-heavy chat prompts, greedy: tokens/s without and with
    n-gram speculation in one run, per batch size."""
    out: dict = {"output_len": n_out, "rows": []}
    engines = {
        "plain": {},
        "ngram": dict(speculative_algorithm="NGRAM", speculative_num_steps=steps),
    }
    results: dict = {}
    for name, spec in engines.items():
        llm = braid.LLM(show_progress=False, **spec)
        try:
            wait_for_graphs(llm)
            sp = braid.SamplingParams(temperature=0.0, max_tokens=n_out)
            convs = [[{"role": "user", "content": t}] for t in TASKS.values()]
            llm.chat(convs[0], sp, use_tqdm=False)  # warm-up
            for b in batches:
                batch = [convs[i % len(convs)] for i in range(b)]
                times, outs = [], None
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    outs = llm.chat(batch, sp, use_tqdm=False)
                    times.append(time.perf_counter() - t0)
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                results[(name, b)] = {
                    "seconds": times,
                    "tokens": tokens,
                    "tok_s": tokens / min(times),
                    "texts": [o.outputs[0].text for o in outs],
                    "metrics": [o.metrics for o in outs],
                }
            results[(name, "stats")] = llm.stats()
        finally:
            llm.shutdown()
    for b in batches:
        plain, ngram = results[("plain", b)], results[("ngram", b)]
        row = {
            "batch": b,
            "plain_tok_s": plain["tok_s"],
            "ngram_tok_s": ngram["tok_s"],
            "speedup": ngram["tok_s"] / plain["tok_s"],
            "same_text": plain["texts"] == ngram["texts"],
            "accept_length": [m.get("spec_accept_length") for m in ngram["metrics"]],
        }
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
    out["ngram_stats"] = results[("ngram", "stats")]
    out["example_output"] = results[("ngram", batches[0])]["texts"][0][:400]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny-cpu", action="store_true", help="toy model on the CPU")
    ap.add_argument("--smollm2", action="store_true", help="CPU, the embedded model's weights")
    ap.add_argument("--batches", default=None, help="verify cost batch sizes (default 1,4,16,64)")
    ap.add_argument("--ks", default="2,4,8")
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per verify cell")
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-verify", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smollm2:
        res = {"smollm2": smollm2_speed(args.output_len or 96, [1, 4], 4, args.repeats)}
        write_result("speculative", "cpu", args.out or None, res)
        return
    tiny = args.tiny_cpu
    device = "cpu" if tiny or not torch.cuda.is_available() else "cuda"
    model_dir = CONFIGS / ("tiny-llama" if tiny else "llama-3.1-8b")
    batches = [int(b) for b in (args.batches or ("1,2" if tiny else "1,4,16,64")).split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    res: dict = {"model": model_dir.name}
    if not args.skip_verify:
        res["verify"] = verify_cost(
            model_dir,
            batches,
            ks,
            args.context or (16 if tiny else 512),
            args.steps or (4 if tiny else 50),
            device,
        )
    res["ngram"] = ngram_speed(
        model_dir,
        16 if tiny else 128,
        args.output_len or (48 if tiny else 512),
        [4, 8],
        device,
        args.repeats,
    )
    write_result("speculative", device, args.out, res)
    for row in res.get("verify", []):
        cells = " ".join(f"k{k}: {row[f'verify_k{k}_over_decode']:.2f}x" for k in ks)
        print(f"batch {row['batch']:>3}: decode {row['decode_ms']:.2f} ms; verify/decode {cells}")
    for workload in ("random", "looping"):
        ng = res["ngram"][workload]
        print(f"n-gram batch 1, {workload} model: output period {ng['period']}")
        for run in ng["runs"]:
            extra = f" speedup {run['speedup']:.2f}x" if "speedup" in run else ""
            print(
                f"  steps {run['num_steps']}: {run['tok_s']:.1f} tok/s, accept length "
                f"{run['accept_length']}, same tokens {run['same_tokens']}{extra}"
            )


if __name__ == "__main__":
    main()
