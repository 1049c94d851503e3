"""The front end's line to the scheduler (`Outbox`) over a real ZMQ PUSH/PULL pair: requests
submitted together arrive as one message, and nothing overtakes them."""

from __future__ import annotations

import pytest
import zmq

import braid
from braid import SamplingParams
from braid.runtime.ipc import codec
from braid.runtime.ipc.sockets import Outbox
from braid.runtime.ipc.to_scheduler import AbortReq, ControlReq, GenerateBatch, GenerateReq


@pytest.fixture()
def pair():
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    yield Outbox(push, max_held=5), pull
    push.close(0)
    pull.close(0)
    ctx.term()


def received(pull: zmq.Socket, count: int) -> list[object]:
    """The next `count` messages (each within 10 s), and then no other for 300 ms."""
    out = []
    for _ in range(count):
        assert pull.poll(10_000), f"only {len(out)} of {count} messages came"
        out.append(codec.decode(pull.recv_multipart()))
    assert not pull.poll(300), "more messages came"
    return out


def req(rid: str) -> list[bytes]:
    return codec.encode(GenerateReq(rid, [1, 2], SamplingParams(), 7))


def rids(msg: object) -> list[str]:
    return [r.rid for r in msg.reqs] if isinstance(msg, GenerateBatch) else [msg.rid]


def test_requests_submitted_together_arrive_as_one_message(pair):
    out, pull = pair
    with out.together():
        out.requests([req("a")])
        out.requests([req("b/0"), req("b/1")])
        out.requests([req("c")])
        assert not pull.poll(300)  # held until the block ends
    (msg,) = received(pull, 1)
    assert isinstance(msg, GenerateBatch) and rids(msg) == ["a", "b/0", "b/1", "c"]
    assert msg.reqs[0] == GenerateReq("a", [1, 2], SamplingParams(), 7)


def test_outside_a_block_one_sample_goes_alone_and_a_prompts_samples_together(pair):
    out, pull = pair
    out.requests([req("a")])
    out.requests([req("b/0"), req("b/1")])
    a, b = received(pull, 2)
    assert isinstance(a, GenerateReq) and a.rid == "a"
    assert isinstance(b, GenerateBatch) and rids(b) == ["b/0", "b/1"]


def test_an_abort_never_overtakes_a_held_request(pair):
    out, pull = pair
    with out.together():
        out.requests([req("a")])
        out.send(AbortReq("a"))
        out.requests([req("b")])
        out.send(ControlReq(1, "stats"))
    msgs = received(pull, 4)
    assert [type(m).__name__ for m in msgs] == [
        "GenerateBatch",
        "AbortReq",
        "GenerateBatch",
        "ControlReq",
    ]
    assert rids(msgs[0]) == ["a"] and msgs[1].rid == "a" and rids(msgs[2]) == ["b"]


def test_a_long_block_is_sent_every_max_held_requests_and_nested_blocks_are_one(pair):
    out, pull = pair
    with out.together():
        with out.together():
            for i in range(4):
                out.requests([req(f"r{i}")])
        assert not pull.poll(300)  # the inner block's end sends nothing
        for i in range(4, 7):
            out.requests([req(f"r{i}")])
    msgs = received(pull, 2)
    assert [rids(m) for m in msgs] == [[f"r{i}" for i in range(5)], ["r5", "r6"]]


def test_an_offline_batch_is_admitted_in_one_step(tiny_model_dirs):
    """`LLM.generate` sends its prompts together: the scheduler admits all eight in its first
    step, however busy the machine is while they are sent (they were eight messages, and a
    busy machine could let the scheduler start on the first few)."""
    with braid.LLM(
        tiny_model_dirs["qwen3"], kv_tokens=512, max_running_requests=8, show_progress=False
    ) as llm:
        for _ in range(3):
            before = llm.stats()
            prompts = [[i + 1] * (3 + i) for i in range(8)]
            sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            outs = llm.generate(prompts, sp, use_tqdm=False)
            after = llm.stats()
            assert [len(o.outputs[0].token_ids) for o in outs] == [1] * 8
            assert after["prefill_steps"] - before["prefill_steps"] == 1


def test_a_block_that_raises_cancels_what_it_sent_and_the_aborts_follow_the_requests(pair):
    out, pull = pair
    with pytest.raises(RuntimeError, match="the runtime died"):
        with out.together(lambda rid: out.send(AbortReq(rid))) as sent:
            for rid in ("a", "b"):
                out.requests([req(rid)])
                sent.append(rid)
            raise RuntimeError("the runtime died")
    msgs = received(pull, 3)
    assert [type(m).__name__ for m in msgs] == ["GenerateBatch", "AbortReq", "AbortReq"]
    assert rids(msgs[0]) == ["a", "b"] and [m.rid for m in msgs[1:]] == ["a", "b"]
