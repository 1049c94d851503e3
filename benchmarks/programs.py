"""braid programs vs plain HTTP requests, in one run, on SmolLM2 (CPU by default).

Workloads:
- few-shot QA: `run_batch` over N questions sharing a long few-shot prefix;
- tree of thought: nested `fork` (2 thoughts, each forked into 2 continuations);
- agent loop: a multi-step program (select an action, gen an argument, append a result).

(a) the programs on a `braid serve` through `RuntimeEndpoint` (radix cache, program sessions);
(b) the same requests as plain, independent HTTP /generate calls that carry the full text each
time, against a server without prefix reuse (what a client of a cache-less server does).
Reported: wall time and prefill tokens computed (from the servers' counters).

Also: program sessions on vs off, for agent programs competing for a small KV cache
(in-process Engine backend): prefill tokens computed and wall time.

    python benchmarks/programs.py                  # 256 questions (the figure in the docs)
    python benchmarks/programs.py --questions 16   # a quick look
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

import braid as sgl  # noqa: E402
from braid.runtime.server.launcher import start_server  # noqa: E402

FEW_SHOT = "".join(
    f"Question: What is the capital of {c}?\nAnswer: {a}\n\n"
    for c, a in [
        ("Italy", "Rome"),
        ("Spain", "Madrid"),
        ("Japan", "Tokyo"),
        ("Kenya", "Nairobi"),
        ("Peru", "Lima"),
        ("Norway", "Oslo"),
        ("Egypt", "Cairo"),
        ("Chile", "Santiago"),
    ]
)
COUNTRIES = ["France", "Germany", "Canada", "India", "Brazil", "Mexico", "Poland", "Greece"]
ANSWER_TOKENS = 6


@sgl.function
def few_shot(s, question):
    s += FEW_SHOT + "Question: " + question + "\nAnswer:"
    s += sgl.gen("answer", max_tokens=ANSWER_TOKENS, stop="\n", temperature=0, ignore_eos=True)


TOT_PROMPT = "Problem: plan a short trip to the mountains on a small budget.\n" * 3


@sgl.function
def tree_of_thought(s, i):
    s += TOT_PROMPT + f"Plan {i}.\n"
    thoughts = s.fork(2)
    thoughts += lambda j: f"Idea {j + 1}:"
    thoughts += sgl.gen("idea", max_tokens=8, temperature=0, ignore_eos=True)
    for t in thoughts:
        leaves = t.fork(2)
        leaves += lambda k: f"\nStep {k + 1}:"
        leaves += sgl.gen("step", max_tokens=8, temperature=0, ignore_eos=True)
        leaves.join()
    thoughts.join()


AGENT_PROMPT = "You are an agent with tools: lookup, finish. Think step by step.\n" * 4


@sgl.function
def agent(s, task, steps=3):
    s += AGENT_PROMPT + "Task: " + task + "\n"
    for i in range(steps):
        s += f"Step {i}: action:"
        s += sgl.select(f"action{i}", choices=[" lookup", " finish"])
        s += " argument:"
        s += sgl.gen(f"arg{i}", max_tokens=6, temperature=0, ignore_eos=True)
        s += f"\nResult {i}: the lookup returned {len(s[f'arg{i}'])} characters.\n"


def stats(url: str) -> dict:
    return httpx.get(f"{url}/get_server_info").json()["stats"]


def plain(url: str, text: str, max_tokens: int) -> str:
    body = {
        "text": text,
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    }
    return httpx.post(f"{url}/generate", json=body, timeout=600).json()["text"]


def plain_choice(url: str, text: str, choices: list[str]) -> str:
    """select as a client of a plain server does it: score each full text separately."""
    best, best_lp = choices[0], float("-inf")
    for c in choices:
        body = {
            "text": text + c,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": 1,
        }
        lps = httpx.post(f"{url}/generate", json=body, timeout=600).json()["meta_info"][
            "input_token_logprobs"
        ]
        lp = lps[-1][0]
        if lp > best_lp:
            best, best_lp = c, lp
    return best


def run_plain(url: str, workload: str, n: int, threads: int) -> None:
    def few(i):
        q = f"What is the capital of {COUNTRIES[i % len(COUNTRIES)]}?"
        plain(url, FEW_SHOT + "Question: " + q + "\nAnswer:", ANSWER_TOKENS)

    def tot(i):
        base = TOT_PROMPT + f"Plan {i}.\n"
        for j in range(2):
            t = base + f"Idea {j + 1}:"
            t += plain(url, t, 8)
            for k in range(2):
                leaf = t + f"\nStep {k + 1}:"
                plain(url, leaf, 8)

    def ag(i):
        text = AGENT_PROMPT + f"Task: find fact {i}\n"
        for step in range(3):
            text += f"Step {step}: action:"
            text += plain_choice(url, text, [" lookup", " finish"])
            text += " argument:"
            arg = plain(url, text, 6)
            text += arg + f"\nResult {step}: the lookup returned {len(arg)} characters.\n"

    fn = {"few_shot": few, "tree_of_thought": tot, "agent": ag}[workload]
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fn, range(n)))


def run_programs(backend, workload: str, n: int) -> None:
    if workload == "few_shot":
        qs = [
            {"question": f"What is the capital of {COUNTRIES[i % len(COUNTRIES)]}?"}
            for i in range(n)
        ]
        few_shot.run_batch(qs, backend=backend, progress_bar=True)
    elif workload == "tree_of_thought":
        tree_of_thought.run_batch([{"i": i} for i in range(n)], backend=backend)
    else:
        agent.run_batch([{"task": f"find fact {i}"} for i in range(n)], backend=backend)


def measure(url: str, fn) -> dict:
    before = stats(url)
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    after = stats(url)
    return {
        "wall_s": round(wall, 2),
        "prefill_tokens_computed": int(
            after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
        ),
    }


def sessions_ab(n: int, kv_tokens: int) -> dict:
    """Agent programs while unrelated traffic churns a small KV cache, program sessions on vs
    off: how many of the agents' prompt tokens had to be recomputed, and wall time."""
    import threading

    from braid import SamplingParams
    from braid.lang.backends.engine import EngineBackend

    out = {}
    llm = sgl.LLM(kv_tokens=kv_tokens, show_progress=False)
    flood_params = SamplingParams(temperature=0, max_tokens=1)
    try:
        backend = EngineBackend(llm)
        for on in (False, True):
            llm.flush_cache()
            agent.sessions = on
            stop = threading.Event()

            def flood(stop=stop) -> None:
                i = 0
                while not stop.is_set():
                    docs = [
                        f"Unrelated document {i}-{j}: " + "filler words here. " * 30
                        for j in range(4)
                    ]
                    llm.generate(docs, flood_params, use_tqdm=False)
                    i += 1

            thread = threading.Thread(target=flood, daemon=True)
            before = llm.stats()
            t0 = time.perf_counter()
            thread.start()
            states = agent.run_batch(
                [{"task": f"find fact {i}"} for i in range(n)], backend=backend
            )
            wall = time.perf_counter() - t0
            stop.set()
            thread.join()
            after = llm.stats()
            metas = [st.get_meta_info(f"arg{k}") for st in states for k in range(3)]
            out["on" if on else "off"] = {
                "wall_s": round(wall, 2),
                "agent_prompt_tokens": sum(m["prompt_tokens"] for m in metas),
                "agent_prompt_tokens_recomputed": sum(
                    m["prompt_tokens"] - m["cached_tokens"] for m in metas
                ),
                "evicted_tokens": int(after["evicted_tokens"] - before["evicted_tokens"]),
            }
        agent.sessions = True
    finally:
        llm.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--questions", type=int, default=256)
    ap.add_argument("--trees", type=int, default=16)
    ap.add_argument("--agents", type=int, default=16)
    ap.add_argument("--threads", type=int, default=64, help="client threads of the plain path")
    ap.add_argument("--session-kv-tokens", type=int, default=1024)
    ap.add_argument("--only-sessions", action="store_true", help="just the sessions A/B")
    ap.add_argument(
        "--agent-traffic",
        action="store_true",
        help="just the agent-traffic comparison of scheduling policies: benchmarks/agents.py, "
        "which takes the arguments this parser does not know (--programs, --rates, ...)",
    )
    ap.add_argument("--out", default=None)
    args, rest = ap.parse_known_args()
    if rest and not args.agent_traffic:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.agent_traffic:
        import agents

        sys.argv = [sys.argv[0], *rest] + (["--out", args.out] if args.out else [])
        agents.main()
        return
    if args.only_sessions:
        print("sessions", sessions_ab(args.agents, args.session_kv_tokens))
        return

    sizes = {"few_shot": args.questions, "tree_of_thought": args.trees, "agent": args.agents}
    results: dict = {"workloads": {}}
    with tempfile.TemporaryDirectory() as tmp:
        cached = start_server(tmp, kv_tokens=32768)
        try:
            backend = sgl.RuntimeEndpoint(cached.url)
            for w, n in sizes.items():
                results["workloads"][w] = {
                    "n": n,
                    "program": measure(cached.url, lambda w=w, n=n: run_programs(backend, w, n)),
                }
                print(w, "program", results["workloads"][w]["program"], flush=True)
        finally:
            cached.stop()
        bare = start_server(tmp, "--disable-radix-cache", kv_tokens=32768)
        try:
            for w, n in sizes.items():
                r = results["workloads"][w]
                r["plain_http"] = measure(
                    bare.url, lambda w=w, n=n: run_plain(bare.url, w, n, args.threads)
                )
                r["speedup"] = round(r["plain_http"]["wall_s"] / r["program"]["wall_s"], 2)
                r["prefill_ratio"] = round(
                    r["plain_http"]["prefill_tokens_computed"]
                    / max(1, r["program"]["prefill_tokens_computed"]),
                    2,
                )
                print(w, "plain", r["plain_http"], "speedup", r["speedup"], flush=True)
        finally:
            bare.stop()
    results["sessions"] = sessions_ab(args.agents, args.session_kv_tokens)
    print("sessions", results["sessions"])
    write_result("programs", "cpu", args.out, results)


if __name__ == "__main__":
    main()
