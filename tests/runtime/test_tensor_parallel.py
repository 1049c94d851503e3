"""Tensor parallelism on CPU over gloo: one process per rank, rank 0 planning and the others
running its plans. Greedy float32 tokens at tp=2 equal tp=1 and transformers' for llama (GQA),
qwen2 (QKV bias, tied embeddings) and qwen3 (q/k norms), with prefix hits, chunked prefill and
retraction, every rank's table checked against rank 0's; KV heads replicated when there are
fewer than ranks and a vocabulary that does not split evenly; each rank loads only its block
of every weight; a rank that dies takes the runtime down within seconds with no process left;
two `braid serve` invocations form one group across two "nodes"."""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM

import braid
from braid.runtime.config import EngineConfig
from braid.runtime.distributed.group import TPGroup, sharding
from braid.runtime.distributed.split import head_shard
from braid.runtime.models.config import ModelConfig
from braid.runtime.models.loader import build_model
from braid.runtime.server.launcher import free_port, start_server
from tests.conftest import hf_greedy, local_scheduler, run_to_end

GREEDY = dict(temperature=0.0, ignore_eos=True)


# ---- the split ----------------------------------------------------------------------------
def test_heads_split_evenly_or_kv_heads_are_replicated():
    # 8 query heads, 4 KV heads over 2 ranks: each rank 4 and 2.
    assert head_shard(8, 4, 1, 2) == head_shard(8, 4, 1, 2)
    s = head_shard(8, 4, 1, 2)
    assert (s.num_heads, s.num_kv_heads, s.q_start, s.kv_start) == (4, 2, 4, 2)
    # 8 query heads, 2 KV heads over 4 ranks: rank r's 2 query heads read KV head r // 2.
    for rank in range(4):
        s = head_shard(8, 2, rank, 4)
        assert (s.num_heads, s.num_kv_heads, s.q_start) == (2, 1, 2 * rank)
        assert s.kv_start == (2 * rank) // 4  # query head 2r is in group (2r) // (8 // 2)
    with pytest.raises(ValueError, match="num_attention_heads \\(9\\) is not a multiple"):
        head_shard(9, 3, 0, 2)
    with pytest.raises(ValueError, match="num_key_value_heads \\(6\\) is not a multiple"):
        head_shard(12, 6, 0, 4)


def test_settings_tensor_parallelism_cannot_carry_are_refused():
    with pytest.raises(ValueError, match="speculative decoding with tp_size > 1"):
        EngineConfig(tp_size=2, speculative_algorithm="NGRAM")
    with pytest.raises(ValueError, match="quantization \\(w8a16\\) with tp_size > 1"):
        EngineConfig(tp_size=2, quantization="w8a16")
    with pytest.raises(ValueError, match="nnodes > 1 needs dist_init_addr"):
        EngineConfig(tp_size=2, nnodes=2)
    with pytest.raises(ValueError, match="must be a multiple of nnodes"):
        EngineConfig(tp_size=3, nnodes=2, dist_init_addr="127.0.0.1:1234")
    with pytest.raises(ValueError, match="node_rank must be in"):
        EngineConfig(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="127.0.0.1:1234")
    with pytest.raises(ValueError, match="dist_init_addr must be host:port"):
        EngineConfig(tp_size=2, dist_init_addr="localhost")
    assert not EngineConfig(tp_size=2, device="cpu").use_overlap_schedule
    assert EngineConfig(tp_size=2, device="cuda").use_overlap_schedule
    with pytest.raises(ValueError, match="unknown engine setting"):
        braid.LLM(tensor_parallel_sise=2)


@pytest.fixture(scope="module")
def odd_model(tmp_path_factory) -> Path:
    """A Llama with 1 KV head (replicated at tp=2) and a vocabulary of 509 (not a multiple
    of 2: the last rank's block is padded)."""
    import transformers as tf

    torch.manual_seed(7)
    cfg = tf.LlamaConfig(
        vocab_size=509,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=512,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    path = tmp_path_factory.mktemp("tp-odd")
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(path))
    return path


def test_each_rank_loads_its_block_of_every_weight(odd_model):
    """Rank 1 of 2 (no process group needed to load): its heads' rows of q/k/v, its columns of
    o_proj and down_proj, its MLP rows, its vocabulary block (padding zeroed), from
    safetensors slices."""
    from safetensors.torch import load_file

    hf = load_file(str(odd_model / "model.safetensors"))
    rank1 = TPGroup(rank=1, size=2, local_rank=1, device_group=None, cpu_group=None)
    seen: list[str] = []
    with sharding(rank1):
        model = build_model(
            ModelConfig.from_dir(odd_model),
            None,
            dtype=torch.float32,
            device=torch.device("cpu"),
            max_positions=512,
            load_format="dummy",
            progress=False,
        )
    # Load by hand through the real loader, watching what each parameter is handed.
    for name, p in model.named_parameters():
        if getattr(p, "reads_slices", False):
            real = p.weight_loader

            def spy(param, loaded, shard, real=real, name=name):
                seen.append(f"{name}:{type(loaded).__name__}")
                real(param, loaded, shard)

            p.weight_loader = spy
    from braid.runtime.models.loader import load_weights

    load_weights(model, odd_model, progress=False)
    layer = model.model.layers[0]
    d = 16  # head_dim
    q, k, v = layer.self_attn.qkv_proj.weight.split([2 * d, d, d])
    assert torch.equal(q, hf["model.layers.0.self_attn.q_proj.weight"][2 * d : 4 * d])
    # One KV head in all: every rank holds it.
    assert torch.equal(k, hf["model.layers.0.self_attn.k_proj.weight"])
    assert torch.equal(v, hf["model.layers.0.self_attn.v_proj.weight"])
    o = hf["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(layer.self_attn.o_proj.weight, o[:, 2 * d : 4 * d])
    gate, up = layer.mlp.gate_up_proj.weight.split([48, 48])
    assert torch.equal(gate, hf["model.layers.0.mlp.gate_proj.weight"][48:])
    assert torch.equal(up, hf["model.layers.0.mlp.up_proj.weight"][48:])
    assert torch.equal(
        layer.mlp.down_proj.weight, hf["model.layers.0.mlp.down_proj.weight"][:, 48:]
    )
    emb = model.model.embed_tokens.weight  # ids 255 .. 508, then one padding row
    assert emb.shape == (255, 64)
    assert torch.equal(emb[:254], hf["model.embed_tokens.weight"][255:])
    assert not emb[254].any()
    assert torch.equal(model.lm_head.weight[:254], hf["lm_head.weight"][255:])
    # What the loader handed the split parameters: slices of the file, not whole tensors.
    assert seen and all(s.endswith(":PySafeSlice") for s in seen), seen[:3]


# ---- whole runtimes -----------------------------------------------------------------------
def _prompts(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    shared = [rng.randrange(512) for _ in range(45)]
    cached = [shared + [rng.randrange(512) for _ in range(k)] for k in (3, 20, 41)]
    pressure = [[rng.randrange(512) for _ in range(20)] for _ in range(6)]
    return cached, pressure


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tp2_matches_tp1_and_transformers_with_hits_chunks_and_retraction(tiny_model_dirs, arch):
    path = tiny_model_dirs[arch]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    cached, pressure = _prompts(seed=len(arch))
    expected_cached = [hf_greedy(hf, p, 10, eos=False) for p in cached]
    expected_pressure = [hf_greedy(hf, p, 40, eos=False) for p in pressure]
    if arch == "llama":  # tp=1, in this process: the same tokens
        s = local_scheduler(path, kv_tokens=2048)
        from braid.runtime.ipc.to_scheduler import GenerateReq

        for i, p in enumerate(cached):
            s.handle(GenerateReq(f"r{i}", p, braid.SamplingParams(max_tokens=10, **GREEDY), 0))
        out = run_to_end(s)
        assert [out[f"r{i}"] for i in range(3)] == expected_cached
    # 6 x (20 + 40) tokens of KV wanted at once; the pool holds 192: some are retracted.
    cfg = dict(kv_tokens=192, chunked_prefill_size=16, tp_size=2, show_progress=False)
    with braid.LLM(path, **cfg) as llm:
        sp = braid.SamplingParams(max_tokens=10, **GREEDY)
        first = llm.generate([cached[0]], sp, use_tqdm=False)[0]  # 48 tokens: 3 chunks
        rest = llm.generate(cached[1:], sp, use_tqdm=False)
        assert all(o.num_cached_tokens >= 40 for o in rest)  # the shared prefix was a hit
        assert [first.outputs[0].token_ids] + [o.outputs[0].token_ids for o in rest] == (
            expected_cached
        )
        llm.check_invariants()  # rank 0's accounting, and rank 1's table equals rank 0's
        outs = llm.generate(pressure, braid.SamplingParams(max_tokens=40, **GREEDY), use_tqdm=False)
        assert llm.stats()["retractions"] > 0
        assert [o.outputs[0].token_ids for o in outs] == expected_pressure
        llm.check_invariants()


def test_overlapped_decode_at_tp2_gives_the_tokens_of_tp2_without_it(tmp_path_factory):
    """The overlap schedule under tensor parallelism: a decode queued before the one before it
    is read back takes that step's samples as input, which rank 0 shares with the other ranks
    on the device (`PlanSender.share`). Greedy and seeded sampled rows, grammar rows (their
    sampling queued after the forward), stops at EOS and at the length limit (the next step
    keeps a subset of the samples' rows): the same tokens as without overlap."""
    from tests.runtime.test_grammar_batch import KEYED
    from tests.runtime.tiny_tokenizers import build_tiny_constrained_model

    path, _ = build_tiny_constrained_model(tmp_path_factory.mktemp("tp-overlap"))
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randrange(4, 30))] for _ in range(10)]
    params = []
    for i in range(len(prompts)):
        kw = dict(max_tokens=[6, 11, 23, 30][i % 4], seed=i)
        kw["temperature"] = 0.0 if i % 3 else 0.8
        if i % 5 == 4:
            kw["regex"] = KEYED
        params.append(braid.SamplingParams(**kw))
    got = {}
    for overlap in (False, True):
        cfg = dict(kv_tokens=1024, tp_size=2, overlap_schedule=overlap, show_progress=False)
        with braid.LLM(path, **cfg) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            got[overlap] = [o.outputs[0].token_ids for o in outs]
            stats = llm.stats()
            assert stats["tp_one_shot_all_reduce"] == 0.0  # CPU: gloo for every all-reduce
            assert (stats["decode_steps_ahead"] > 20) is overlap, stats["decode_steps_ahead"]
            assert (stats["constrained_steps_ahead"] > 0) is overlap
            llm.check_invariants()
    assert got[True] == got[False]
    lengths = {len(t) for t in got[True]}
    assert len(lengths) >= 4, lengths  # finishes by length (6, 11, 23, 30) and at EOS/grammar


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_replicated_kv_heads_and_padded_vocab_then_a_dead_rank_ends_the_runtime(odd_model):
    hf = AutoModelForCausalLM.from_pretrained(str(odd_model), dtype=torch.float32).eval()
    rng = random.Random(11)
    prompts = [[rng.randrange(509) for _ in range(k)] for k in (4, 19, 33)]
    expected = [hf_greedy(hf, p, 12, eos=False) for p in prompts]
    sp = braid.SamplingParams(max_tokens=12, **GREEDY)
    llm = braid.LLM(odd_model, kv_tokens=512, tp_size=2, show_progress=False)
    try:
        outs = llm.generate(prompts, sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        # Ids in the last rank's block (508) and the first's (0) embed as transformers does.
        edge = [[508, 0, 254, 255, 508]]
        assert llm.generate(edge, sp, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(
            hf, edge[0], 12, eos=False
        )
        procs = dict(llm.tm.procs)
        assert set(procs) == {"scheduler", "detokenizer", "tp-rank-1"}
        os.kill(procs["tp-rank-1"].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="tensor-parallel|tp-rank-1"):
            while time.monotonic() - t0 < 30:
                llm.generate([prompts[0]], sp, use_tqdm=False)
                time.sleep(0.2)
        assert time.monotonic() - t0 < 10
    finally:
        llm.shutdown()
    deadline = time.monotonic() + 10
    while any(_alive(p.pid) for p in procs.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [n for n, p in procs.items() if _alive(p.pid)]


def test_sigterm_to_the_scheduler_stops_the_other_ranks_cleanly(tiny_model_dirs):
    """The front end sends SIGTERM to a scheduler that has not stopped within 3 s of its
    ShutdownReq (a loaded machine): the scheduler then stops as it would for the request, and
    tells the other ranks, which exit 0 (without it, rank 0 died at once and rank 1 exited 1,
    as a dead rank 0 makes it)."""
    llm = braid.LLM(tiny_model_dirs["llama"], kv_tokens=256, tp_size=2, show_progress=False)
    try:
        assert llm.generate([[1, 2, 3]], braid.SamplingParams(max_tokens=2), use_tqdm=False)
        procs = dict(llm.tm.procs)
        os.kill(procs["scheduler"].pid, signal.SIGTERM)
        for name in ("scheduler", "tp-rank-1"):
            procs[name].join(20)
            assert procs[name].exitcode == 0, (name, procs[name].exitcode)
    finally:
        llm.shutdown()


def test_a_split_that_does_not_divide_fails_at_start_naming_it(tiny_model_dirs):
    """Refused in the front end, from config.json, before any runtime process starts."""
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(ValueError, match="num_attention_heads \\(4\\) is not a multiple of"):
        braid.LLM(tiny_model_dirs["llama"], kv_tokens=256, tp_size=3, show_progress=False)
    assert not set(psutil.Process().children(recursive=True)) - before  # none started
    cfg = ModelConfig.from_dir(tiny_model_dirs["llama"])
    cfg.check_engine(EngineConfig(tp_size=2))  # 4 query heads, 2 KV heads: even
    with pytest.raises(
        ValueError, match="intermediate_size \\(66\\) is not a multiple of tp_size \\(4\\)"
    ):
        dataclasses.replace(cfg, intermediate_size=66).check_engine(EngineConfig(tp_size=4))


def test_serve_with_a_split_that_does_not_divide_exits_2_before_the_runtime(tiny_model_dirs):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "braid",
            "serve",
            "--model",
            str(tiny_model_dirs["llama"]),
            "--tp-size",
            "3",
            "--device",
            "cpu",
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    errors = [line for line in run.stderr.splitlines() if "is not a multiple of" in line]
    assert len(errors) == 1 and "num_attention_heads (4)" in errors[0], run.stderr
    assert "KV cache" not in run.stderr and "Traceback" not in run.stderr


def test_two_braid_serve_nodes_form_one_group(tmp_path):
    """Node 0 serves (rank 0); node 1 runs rank 1 only; they meet at --dist-init-addr. Tokens
    through the real openai client equal transformers'; SIGTERM to node 0 stops node 1."""
    import openai

    from tests.runtime.tiny_tokenizers import build_tiny_constrained_model

    path, _ = build_tiny_constrained_model(tmp_path / "model")
    addr = f"127.0.0.1:{free_port()}"
    common = ["--model", str(path), "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr]
    log1 = open(tmp_path / "node1.log", "w")
    node1 = subprocess.Popen(
        [sys.executable, "-m", "braid", "serve", *common, "--node-rank", "1"],
        stdout=log1,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        node0 = start_server(tmp_path, *common, "--node-rank", "0", kv_tokens=1024)
        try:
            info = braid_info(node0.url)
            assert info["tp_size"] == 2
            client = openai.OpenAI(base_url=node0.url + "/v1", api_key="none")
            prompt = "the cat sat on the mat and"
            r = client.completions.create(
                model="x",
                prompt=prompt,
                max_tokens=8,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(path))
            hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
            ids = tok.encode(prompt)
            want = tok.decode(hf_greedy(hf, ids, 8, eos=False), skip_special_tokens=True)
            assert r.choices[0].text == want
        finally:
            node0.stop()
        node1.wait(timeout=15)
        assert node1.returncode == 0, (tmp_path / "node1.log").read_text()[-2000:]
    finally:
        if node1.poll() is None:
            node1.kill()
        log1.close()


def braid_info(url: str) -> dict:
    import httpx

    return httpx.get(url + "/get_server_info").json()


# ---- two GPUs: NCCL, CUDA graphs (issue 24's run) ------------------------------------------
TWO_GPUS = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
)
GPU_TP = dict(kv_tokens=4096, device="cuda", show_progress=False)


@pytest.mark.gpu
@TWO_GPUS
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gpu_tp2_over_nccl_with_graphs_equals_tp1_eager_in_float32(tiny_model_dirs, arch):
    """Decode steps replayed from CUDA graphs that hold NCCL all-reduces give, in float32, the
    tokens of one GPU running eagerly; with prefix hits and chunked prefill too."""
    path = tiny_model_dirs[arch]
    cached, pressure = _prompts(seed=len(arch))
    prompts = cached + pressure
    sp = braid.SamplingParams(max_tokens=24, **GREEDY)
    with braid.LLM(path, dtype="float32", disable_cuda_graph=True, **GPU_TP) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, sp, use_tqdm=False)]
    cfg = dict(dtype="float32", tp_size=2, chunked_prefill_size=16, **GPU_TP)
    with braid.LLM(path, **cfg) as two:
        # The decode all-reduces take the one-shot path, and the steps run ahead (overlap).
        assert two.stats()["tp_one_shot_all_reduce"] == 1.0
        outs = two.generate(prompts, sp, use_tqdm=False)
        assert two.stats()["decode_steps_ahead"] > 0
        assert [o.outputs[0].token_ids for o in outs] == expected
        again = two.generate(cached, sp, use_tqdm=False)  # the shared prefix is cached now
        assert all(o.num_cached_tokens >= 40 for o in again)
        assert [o.outputs[0].token_ids for o in again] == expected[: len(cached)]
        two.check_invariants()


@pytest.mark.gpu
@TWO_GPUS
def test_gpu_tp2_in_bfloat16_runs_and_keeps_the_ranks_in_step(tiny_model_dirs):
    """bf16 at tp=2: all-reduce order rounds differently from one GPU, so tokens are not
    compared; every request finishes with its full length and every rank's table equals
    rank 0's."""
    cached, pressure = _prompts(seed=3)
    sp = braid.SamplingParams(max_tokens=32, **GREEDY)
    with braid.LLM(tiny_model_dirs["llama"], dtype="bfloat16", tp_size=2, **GPU_TP) as two:
        outs = two.generate(cached + pressure, sp, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [32] * len(outs)
        two.check_invariants()


def test_the_rank_plan_carries_a_mixed_extends_decode_tail():
    """Every rank runs a mixed step's decode rows as rank 0 does (`ForwardBatch.decode_tail`)."""
    from braid.runtime.distributed.plan import decode_batch, encode_batch
    from braid.runtime.forward_batch import ForwardBatch, ForwardMode

    t = torch.tensor
    batch = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=t([5, 6, 7, 8]),
        positions=t([0, 1, 9, 4]),
        out_cache_loc=t([10, 11, 12, 13]),
        req_pool_indices=t([0, 1, 2]),
        seq_lens=t([2, 10, 5]),
        prefix_lens=[0, 9, 4],
        extend_lens=[2, 1, 1],
        logits_indices=t([1, 2, 3]),
        decode_tail=2,
    )
    back = decode_batch(encode_batch(batch), torch.device("cpu"))
    assert back.decode_tail == 2 and back.extend_lens == [2, 1, 1]
    assert torch.equal(back.seq_lens, batch.seq_lens)


def _two_ranks(target, arg) -> dict:
    """Run `target(rank, port, arg, queue)` as ranks 0 and 1 of a gloo group in two spawned
    processes; what each puts on the queue as (rank, result), by rank."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, arg, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(10)
    return results


def _payload(n: int) -> dict:
    return {"n": n, "data": bytes(range(256)) * (n // 256) + b"x" * (n % 256)}


def _broadcast_rank(rank: int, port: int, sizes: list[int], queue) -> None:
    from braid.runtime.distributed.group import init_group

    group = init_group(rank, 2, rank, f"127.0.0.1:{port}", torch.device("cpu"))
    try:
        got = []
        for n in sizes:
            obj = _payload(n)
            back = group.broadcast_object(obj if rank == 0 else None)
            got.append(back == obj)
        samples = torch.arange(5) * 7 if rank == 0 else torch.zeros(5, dtype=torch.int64)
        group.broadcast(samples)
        got.append(samples.tolist() == [0, 7, 14, 21, 28])
        queue.put((rank, got))
    finally:
        group.destroy()


def test_objects_of_every_size_around_the_plan_slot_reach_the_other_rank():
    """`broadcast_object` sends a plan in one message when it fits the slot and the rest in a
    second; sizes on both sides of the slot's edge arrive whole, as do device broadcasts."""
    import pickle

    from braid.runtime.distributed.group import OBJECT_SLOT

    def pickled(n: int) -> int:
        return len(pickle.dumps(_payload(n), protocol=pickle.HIGHEST_PROTOCOL))

    # The payload whose pickle fills the slot after its 8-byte length exactly, and its
    # neighbours on both sides.
    edge = next(n for n in range(OBJECT_SLOT - 200, OBJECT_SLOT) if pickled(n) == OBJECT_SLOT - 8)
    sizes = [0, 1000, *range(edge - 3, edge + 4), 3 * OBJECT_SLOT + 5]
    assert pickled(edge - 1) < OBJECT_SLOT - 8 < pickled(edge + 1)
    results = _two_ranks(_broadcast_rank, sizes)
    assert results[0] == results[1] == [True] * (len(sizes) + 1)


def _one_shot_rank(rank: int, port: int, allowed: list[bool], queue) -> None:
    from braid.runtime.distributed.group import init_group

    group = init_group(rank, 2, rank, f"127.0.0.1:{port}", torch.device("cpu"))
    try:
        on = group.enable_one_shot(torch.float32, torch.device("cpu"), allowed[rank])
        x = group.all_reduce(torch.full((3,), float(rank + 1)))
        queue.put((rank, (on, group.one_shot, x.tolist())))
    finally:
        group.destroy()


@pytest.mark.parametrize("allowed", [[True, True], [True, False], [False, True]])
def test_the_ranks_agree_on_the_one_shot_all_reduce_and_fall_back_together(allowed):
    """Where the one-shot all-reduce cannot run on some rank (here: no CUDA at all, or turned
    off on one rank only), no rank waits in a step its peer skipped: all take NCCL's place
    (gloo here) together, and the all-reduce still sums."""
    results = _two_ranks(_one_shot_rank, allowed)
    assert results[0] == results[1] == (False, False, [3.0, 3.0, 3.0])
