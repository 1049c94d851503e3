"""The same programs on all three backends: braid's Engine in-process, a RuntimeEndpoint on a
real `braid serve` (the package's `served`, shared with test_sglang_programs.py), and the OpenAI
backend (the real `openai` client) on that same server. Greedy, so the outputs must be
identical."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

import braid as sgl


@sgl.function
def completion_program(s, question):
    s += "Q: What is the capital of Italy?\nA: Rome\n\nQ: " + question + "\nA:"
    s += sgl.gen("answer", max_tokens=6, stop="\n", temperature=0)
    s += "\nIs that right? Answer:"
    s += sgl.select("check", choices=[" yes", " no"])


@sgl.function
def chat_program(s, question):
    s += sgl.user(question)
    with s.assistant():
        s += sgl.gen("answer", max_tokens=8, temperature=0)


def model_name(url: str) -> str:
    return httpx.get(f"{url}/v1/models").json()["data"][0]["id"]


def test_same_program_same_output_on_all_backends(smollm2, served):
    from braid.lang.backends.engine import EngineBackend

    engine = EngineBackend(smollm2)
    endpoint = sgl.RuntimeEndpoint(served.url)
    openai_backend = sgl.OpenAI(model_name(served.url), base_url=served.url + "/v1")
    q = "What is the capital of France?"
    outs = [
        completion_program.run(question=q, backend=b) for b in (engine, endpoint, openai_backend)
    ]
    assert len({o["answer"] for o in outs}) == 1, [o["answer"] for o in outs]
    assert len({o["check"] for o in outs}) == 1, [o["check"] for o in outs]
    scores = [o.get_meta_info("check")["scores"] for o in outs]
    for other in scores[1:]:
        assert other == pytest.approx(scores[0], abs=1e-3)
    chats = [chat_program.run(question=q, backend=b) for b in (engine, endpoint, openai_backend)]
    assert len({c["answer"] for c in chats}) == 1, [c["answer"] for c in chats]
    assert chats[0].text() == chats[1].text()  # the server's role template is the engine's


def test_runtime_endpoint_sessions_are_released(served):
    endpoint = sgl.RuntimeEndpoint(served.url)
    state = chat_program.run(question="Say hi.", backend=endpoint)
    assert state["answer"]
    stats = httpx.get(f"{served.url}/get_server_info").json()["stats"]
    assert stats["pinned_sessions"] == 0


def test_openai_backend_select_inside_roles_is_a_clear_error(served):
    @sgl.function
    def chat_select(s):
        s += sgl.user("Pick a colour.")
        with s.assistant():
            s += sgl.select("c", choices=["red", "blue"])

    backend = sgl.OpenAI(model_name(served.url), base_url=served.url + "/v1")
    with pytest.raises(sgl.ProgramError, match="select needs prompt log-probabilities"):
        chat_select.run(backend=backend)


@sgl.function
def sampled_program(s):
    s += "Q: Name a colour and say why you like it.\nA:"
    s += sgl.gen("answer", max_tokens=12, temperature=1.0)


def test_a_seed_makes_sampling_reproducible_on_every_backend(smollm2, served):
    """A seeded gen samples the same tokens on every backend, whatever ran in between (an
    unseeded request takes the next seed of the runtime's stream, so repeating it differs);
    `sampling_defaults` gives the seed to a program that does not set one, under the run's and
    the gen's own arguments."""
    from braid.lang.backends.engine import EngineBackend

    backends = [
        EngineBackend(smollm2),
        sgl.RuntimeEndpoint(served.url),
        sgl.OpenAI(model_name(served.url), base_url=served.url + "/v1"),
    ]
    firsts = []
    for b in backends:
        first = sampled_program.run(seed=11, backend=b)["answer"]
        unseeded = [sampled_program.run(backend=b)["answer"] for _ in range(2)]
        assert unseeded[0] != unseeded[1], unseeded  # the stream moved on
        assert sampled_program.run(seed=11, backend=b)["answer"] == first
        with sgl.sampling_defaults(seed=11):
            assert sampled_program.run(backend=b)["answer"] == first
            with sgl.sampling_defaults(seed=12):
                other = sampled_program.run(backend=b)["answer"]
            assert sampled_program.run(seed=12, backend=b)["answer"] == other != first
        firsts.append(first)
    assert len(set(firsts)) == 1, firsts  # one seed, one prompt: the same tokens everywhere
    with pytest.raises(ValueError, match="unknown sampling argument"):
        with sgl.sampling_defaults(sed=1):
            pass


@sgl.function
def sampled_branches(s, own_seed=None):
    s += "Q: Name a colour and say why you like it.\nA:"
    forks = s.fork(2)
    forks += sgl.gen("answer", max_tokens=12, temperature=1.0, seed=own_seed)
    forks.join()


def test_a_runs_seed_gives_each_gen_its_own_and_a_gens_seed_is_kept(smollm2):
    """`run(seed=)` derives each gen's seed from the gen's place (its fork branch, its call
    position): the two branches of a fork differ and the run repeats exactly. A gen's own
    seed is sent as it is: both branches then sample the same text."""
    from braid.lang.backends.engine import EngineBackend

    engine = EngineBackend(smollm2)
    first = sampled_branches.run(seed=5, backend=engine)["answer"]
    assert len(first) == 2 and first[0] != first[1], first
    assert sampled_branches.run(seed=5, backend=engine)["answer"] == first
    own = sampled_branches.run(own_seed=7, backend=engine)["answer"]
    assert own[0] == own[1], own
    alone = sampled_program.run(backend=engine)  # the stream moved on in between
    assert alone["answer"]
    assert sampled_branches.run(own_seed=7, backend=engine)["answer"] == own


def test_openai_backend_refuses_text_a_chat_would_drop(served):
    """A chat sends only the role messages: text written outside any role before or between
    them is refused, naming it, instead of being left out of the request."""

    @sgl.function
    def secret_first(s):
        s += "The password is zebra42.\n"
        s += sgl.user("What is the password?")
        with s.assistant():
            s += sgl.gen("answer", max_tokens=4, temperature=0)

    @sgl.function
    def between_roles(s):
        s += sgl.user("Hi.")
        s += sgl.assistant("Hello.")
        s += "  \n"  # whitespace between the messages is not content
        s += sgl.user("Name a colour.")
        s += "Answer in one word."
        with s.assistant():
            s += sgl.gen("answer", max_tokens=4, temperature=0)

    backend = sgl.OpenAI(model_name(served.url), base_url=served.url + "/v1")
    with pytest.raises(sgl.ProgramError, match="wrote 'The password is zebra42.\\\\n' outside"):
        secret_first.run(backend=backend)
    with pytest.raises(sgl.ProgramError, match="wrote 'Answer in one word.' outside any role"):
        between_roles.run(backend=backend)
    # The same programs run as written on a backend that sends the whole text.
    assert between_roles.run(backend=sgl.RuntimeEndpoint(served.url))["answer"]


def test_openai_backend_meta_info_reads_what_the_server_reports(served):
    """The stop string that matched, the tokens a cut-off gen reached and the cached prompt
    tokens come from the response, as RuntimeEndpoint's meta info has them."""

    @sgl.function
    def counting(s, stop):
        s += "Count: 1, 2, 3, 4, 5,"
        s += sgl.gen("n", max_tokens=6, stop=stop, temperature=0)

    backends = [
        sgl.RuntimeEndpoint(served.url),
        sgl.OpenAI(model_name(served.url), base_url=served.url + "/v1"),
    ]
    for b in backends:
        cut = counting.run(stop=None, backend=b).get_meta_info("n")
        assert cut["finish_reason"] == {"type": "length", "length": 6}, cut
        assert cut["cached_tokens"] > 0, cut  # the prompt was computed by the run before
        stopped = counting.run(stop=[" 7"], backend=b).get_meta_info("n")
        assert stopped["finish_reason"] == {"type": "stop", "matched": " 7"}, stopped


@pytest.mark.parametrize("kind", ["endpoint", "openai"])
def test_a_server_stopping_mid_gen_fails_the_program_with_its_reason(tmp_path, kind):
    """A generation the server ends (here by shutting down) fails the program with the
    server's reason and the program line, on both remote backends; once the server is gone, a
    gen fails naming it, and the program's end that fails after it does not replace that
    error."""
    from tests.server.conftest import start_server

    server = start_server(tmp_path)
    try:
        url = server.url
        backend = (
            sgl.RuntimeEndpoint(url)
            if kind == "endpoint"
            else sgl.OpenAI(model_name(url), base_url=url + "/v1")
        )

        @sgl.function
        def long(s):
            s += "Count: 1, 2,"
            s += sgl.gen("a", max_tokens=4000, ignore_eos=True, temperature=0)

        state = long.run(stream=True, backend=backend)
        deadline = time.monotonic() + 60
        while not httpx.get(f"{url}/get_server_info").json()["stats"]["running_requests"]:
            assert time.monotonic() < deadline, "the gen never started"
            time.sleep(0.1)
        server.proc.send_signal(signal.SIGTERM)
        with pytest.raises(sgl.ProgramError) as info:
            state["a"]
        message = str(info.value)
        assert "generation failed: the server is shutting down" in message, message
        assert "in long" in message, message  # the gen's program line
        assert server.proc.wait(timeout=60) == 0
        # With the server gone the gen fails, and so does the program's end after it: the
        # error is still the gen's.
        with pytest.raises(sgl.ProgramError) as info:
            long.run(backend=backend)
        message = str(info.value)
        assert f"cannot reach {url}" in message and "in long" in message, message
    finally:
        server.stop()
