"""`image()` in programs: on braid's Engine (a tiny random Qwen2.5-VL), against the same
requests made by hand through `LLM.generate`; its prefix sharing across forks and batches;
the OpenAI backend's chat messages; a RuntimeEndpoint on a `braid serve` of the same model;
and the errors."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest

import braid
import braid.lang as sgl
from braid.lang.backends.engine import EngineBackend
from braid.lang.backends.openai import IMAGE_PLACEHOLDER, OpenAI, chat_messages
from braid.runtime.sampling_params import SamplingParams
from tests.multimodal.tiny_vlms import build_tiny_qwen2_vl, tiny_image

QUESTION = "What is in this picture?"
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen25vl") / "model", "2.5")


@pytest.fixture(scope="module")
def vlm(vlm_dir):
    llm = braid.LLM(vlm_dir, kv_tokens=2048, show_progress=False)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def vb(vlm) -> EngineBackend:
    return EngineBackend(vlm)


@pytest.fixture(scope="module")
def picture_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pictures") / "picture.png"
    tiny_image(112, 112, seed=0).save(path)
    return path


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@sgl.function
def describe(s, picture):
    s += sgl.user(sgl.image(picture) + QUESTION)
    s += sgl.assistant(sgl.gen("answer", max_tokens=6, return_logprob=True, **GREEDY))


def by_hand(llm, image, max_tokens: int = 6):
    """The request `describe` makes, built from the chat template and sent with
    `LLM.generate`'s multi_modal_data."""
    conversation = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}
    ]
    text = llm.tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    )
    params = SamplingParams(max_tokens=max_tokens, **GREEDY)
    out = llm.generate(
        {"prompt": text, "multi_modal_data": {"image": image}}, params, use_tqdm=False
    )
    return text, out[0]


def test_image_in_a_user_role_gives_the_tokens_of_the_same_request_by_hand(vlm, vb, picture_file):
    picture = tiny_image(112, 112, seed=0)
    text, ref = by_hand(vlm, picture)
    sources = {
        "str path": str(picture_file),
        "Path": picture_file,
        "bytes": picture_file.read_bytes(),
        "PIL": picture,
        "data URL": "data:image/png;base64," + base64.b64encode(png_bytes(picture)).decode(),
    }
    for kind, source in sources.items():
        state = describe.run(picture=source, backend=vb)
        tokens = [entry[1] for entry in state.get_meta_info("answer")["output_token_logprobs"]]
        assert tokens == ref.outputs[0].token_ids, kind
        assert state["answer"] == ref.outputs[0].text, kind
        # The program's prompt is the chat template's, with the model's placeholder.
        assert state.text() == text + state["answer"] + "<|im_end|>\n", kind
        assert state.get_meta_info("answer")["prompt_tokens"] == len(ref.prompt_token_ids)


def test_top_level_image_and_two_images_run(vlm, vb):
    a, b = tiny_image(112, 112, seed=11), tiny_image(84, 140, seed=12)

    @sgl.function
    def compare(s):
        s += "Compare "
        s += sgl.image(a)
        s += " with "
        s += sgl.image(b)
        s += ":"
        s += sgl.gen("x", max_tokens=4, return_logprob=True, **GREEDY)

    state = compare.run(backend=vb)
    p = vlm.media.placeholder
    ref = vlm.generate(
        {"prompt": f"Compare {p} with {p}:", "multi_modal_data": {"image": [a, b]}},
        SamplingParams(max_tokens=4, **GREEDY),
        use_tqdm=False,
    )[0]
    assert [e[1] for e in state.get_meta_info("x")["output_token_logprobs"]] == (
        ref.outputs[0].token_ids
    )


def test_images_added_in_branches_join_the_parent_in_order(vlm, vb):
    a, b = tiny_image(112, 112, seed=61), tiny_image(112, 84, seed=62)

    @sgl.function
    def gallery(s):
        s += "Pictures:"
        forks = s.fork(2)
        forks += lambda i: sgl.image([a, b][i]) + f" number {i}."
        forks.join("concate_and_append")
        s += " Best:" + sgl.gen("best", max_tokens=4, return_logprob=True, **GREEDY)

    state = gallery.run(backend=vb)
    p = vlm.media.placeholder
    ref = vlm.generate(
        {
            "prompt": f"Pictures:{p} number 0.{p} number 1. Best:",
            "multi_modal_data": {"image": [a, b]},
        },
        SamplingParams(max_tokens=4, **GREEDY),
        use_tqdm=False,
    )[0]
    assert [e[1] for e in state.get_meta_info("best")["output_token_logprobs"]] == (
        ref.outputs[0].token_ids
    )


def test_fork_after_an_image_shares_its_kv_and_encodes_it_once(vlm, vb):
    picture = tiny_image(112, 112, seed=21)

    @sgl.function
    def two_views(s):
        s += sgl.user(sgl.image(picture) + QUESTION)
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += sgl.assistant(f"View {i}:" + sgl.gen("view", max_tokens=3, **GREEDY))
        forks.join()

    before = vlm.stats()
    state = two_views.run(backend=vb)
    after = vlm.stats()
    assert len(state["view"]) == 2 and all(isinstance(v, str) for v in state["view"])
    assert after["images_encoded"] - before["images_encoded"] == 1
    # The text up to the fork, the image's 16 tokens included, is a hit for both branches.
    fork_point = vb.role_template.begin("user", True) + vlm.media.placeholder + QUESTION
    prefix = len(vlm.tokenizer.encode(fork_point)) - 1 + 16
    assert after["cached_prompt_tokens"] - before["cached_prompt_tokens"] >= 2 * prefix


def test_select_after_an_image_scores_each_choice_with_the_image(vlm, vb):
    picture = tiny_image(112, 112, seed=31)
    choices = ["a cat", "a dog", "a red bird"]

    @sgl.function
    def classify(s):
        s += sgl.user(sgl.image(picture) + "Which animal is it?")
        s += sgl.assistant(sgl.select("animal", choices=choices))

    before = vlm.stats()["images_encoded"]
    state = classify.run(backend=vb)
    assert vlm.stats()["images_encoded"] - before == 1  # one image, not one per choice
    assert state["animal"] in choices
    meta = state.get_meta_info("animal")
    # Each choice's log-probabilities are those of the prompt and the choice sent by hand.
    prompt = state.text()[: -len(state["animal"] + "<|im_end|>\n")]
    for choice, scored in zip(choices, meta["input_token_logprobs"]):
        ref = vlm.generate(
            {"prompt": prompt + choice, "multi_modal_data": {"image": picture}},
            SamplingParams(max_tokens=0, prompt_logprobs=0),
            use_tqdm=False,
        )[0]
        ids = ref.prompt_token_ids[-len(scored) :]
        assert [e[1] for e in scored] == ids
        expected = [
            ref.prompt_logprobs[len(ref.prompt_token_ids) - len(scored) + k]
            for k in range(len(scored))
        ]
        for entry, lp, tid in zip(scored, expected, ids):
            assert entry[0] == pytest.approx(lp[tid].logprob, abs=1e-5)


def test_run_batch_over_three_images_encodes_each_once(vlm, vb):
    pictures = [tiny_image(112, 112, seed=41 + i) for i in range(3)]
    before = vlm.stats()["images_encoded"]
    states = describe.run_batch([{"picture": p} for p in pictures], backend=vb)
    assert vlm.stats()["images_encoded"] - before == 3
    assert len(states) == 3
    for state, picture in zip(states, pictures):
        assert state.error() is None
        assert state["answer"] == by_hand(vlm, picture)[1].outputs[0].text


def test_trace_records_an_image_argument():
    graph = describe.trace()
    assert graph.count("image") == 1
    assert graph.of_kind("image")[0].branch == ()


def test_a_select_choice_spelling_an_image_placeholder_is_refused_naming_it(vlm, vb):
    """A choice holding the image token would stand for an image it does not have: a
    ValueError naming the choice, with or without an image in the prompt."""
    pad = "<|image_pad|>" * 3

    @sgl.function
    def pick(s, picture):
        if picture is not None:
            s += sgl.user(sgl.image(picture) + "Which?")
        else:
            s += sgl.user("Which?")
        s += sgl.assistant(sgl.select("c", choices=[pad, "b"]))

    for picture in (None, tiny_image(112, 112, seed=5)):
        with pytest.raises(sgl.ProgramError, match="select choice '<.image_pad.>") as info:
            pick.run(picture=picture, backend=vb)
        assert isinstance(info.value.__cause__, ValueError)
    assert vlm.stats()["running_requests"] == 0


def test_bytes_that_are_not_an_image_fail_naming_the_image(vlm, vb):
    with pytest.raises(sgl.ProgramError, match=r"image 0: bytes \(14 B\): not an image") as info:
        describe.run(picture=b"not an image!!", backend=vb)
    assert isinstance(info.value.__cause__, ValueError)
    assert vlm.stats()["running_requests"] == 0


@pytest.mark.parametrize(
    "source, message",
    [
        (123, "give a path .*bytes, a PIL image, or an http.* URL; got int"),
        (["a.png"], "got list"),
        ("", "empty string"),
        (b"", "bytes are empty"),
        ("/no/such/picture.png", "no such file: /no/such/picture.png"),
        ("data:text/plain;base64,aGk=", "data:image/"),
    ],
)
def test_image_refuses_what_is_not_an_image_source(source, message):
    with pytest.raises(ValueError, match=message):
        sgl.image(source)


def test_image_on_the_text_only_embedded_model_fails_with_a_value_error(backend):
    assert backend.supports_images is False
    with pytest.raises(sgl.ProgramError, match="SmolLM2.* takes text only") as info:
        describe.run(picture=tiny_image(28, 28, seed=0), backend=backend)
    assert isinstance(info.value.__cause__, ValueError)


# ---- OpenAI: the chat messages a program's images become ------------------------------------


def test_chat_messages_put_data_urls_where_the_images_stand(picture_file):
    pil = tiny_image(28, 56, seed=5)
    url = "https://example.com/cat.jpg"
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"{IMAGE_PLACEHOLDER}First, then{IMAGE_PLACEHOLDER}"},
        {"role": "assistant", "content": "Ok."},
        {"role": "user", "content": f"And {IMAGE_PLACEHOLDER}?"},
    ]
    out = chat_messages(messages, [picture_file, pil, url])
    assert out[0] == messages[0] and out[2] == messages[2]  # text-only messages unchanged
    first = out[1]["content"]
    assert [p["type"] for p in first] == ["image_url", "text", "image_url"]
    assert first[1] == {"type": "text", "text": "First, then"}
    png = base64.b64encode(picture_file.read_bytes()).decode()
    assert first[0]["image_url"]["url"] == f"data:image/png;base64,{png}"
    head, payload = first[2]["image_url"]["url"].split(",")
    assert head == "data:image/png;base64"
    from PIL import Image

    decoded = Image.open(io.BytesIO(base64.b64decode(payload)))
    assert decoded.size == (28, 56) and decoded.tobytes() == pil.tobytes()
    assert out[3]["content"] == [
        {"type": "text", "text": "And "},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "?"},
    ]


def test_chat_messages_refuse_bad_bytes_and_images_outside_messages():
    with pytest.raises(ValueError, match=r"bytes \(5 B\) is not an image"):
        chat_messages([{"role": "user", "content": IMAGE_PLACEHOLDER}], [b"hello"])
    with pytest.raises(ValueError, match="hold 0 of the prompt's 1 images"):
        chat_messages([{"role": "user", "content": "hi"}], [b"hello"])


def test_openai_backend_sends_the_program_images_in_its_messages(monkeypatch, picture_file):
    backend = OpenAI("some-vlm", base_url="http://127.0.0.1:9/v1", api_key="x")
    sent = {}

    def create(**kwargs):
        sent.update(kwargs)
        return iter(())

    monkeypatch.setattr(backend.client.chat.completions, "create", create)

    @sgl.function
    def ask(s):
        s += sgl.system("You describe pictures.")
        s += sgl.user("Look: " + sgl.image(picture_file) + "What is it?")
        s += sgl.assistant(sgl.gen("answer", max_tokens=4))

    ask.run(backend=backend)
    png = base64.b64encode(picture_file.read_bytes()).decode()
    assert sent["messages"] == [
        {"role": "system", "content": "You describe pictures."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look: "},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
                {"type": "text", "text": "What is it?"},
            ],
        },
    ]


def test_openai_backend_refuses_images_outside_roles(picture_file):
    backend = OpenAI("some-vlm", base_url="http://127.0.0.1:9/v1", api_key="x")

    @sgl.function
    def bare(s):
        s += sgl.image(picture_file) + "Caption:"
        s += sgl.gen("caption", max_tokens=4)

    with pytest.raises(sgl.ProgramError, match="completions takes text only"):
        bare.run(backend=backend)


# ---- RuntimeEndpoint: /generate's image_data ------------------------------------------------


@pytest.fixture(scope="module")
def endpoint(vlm_dir):
    runtime = sgl.Runtime(str(vlm_dir), max_total_tokens=2048, launch_timeout=90)
    yield runtime.endpoint
    runtime.shutdown()


def test_endpoint_gen_and_select_with_an_image_equal_the_engine(vlm, vb, endpoint, picture_file):
    assert endpoint.image_placeholder == vlm.media.placeholder

    @sgl.function
    def look(s, picture):
        s += sgl.user(sgl.image(picture) + QUESTION)
        s += sgl.assistant(sgl.gen("answer", max_tokens=6, **GREEDY))
        s += sgl.user("Cat or dog?")
        s += sgl.assistant(sgl.select("animal", choices=["cat", "dog"]))

    for source in (picture_file, tiny_image(84, 112, seed=51)):
        remote = look.run(picture=source, backend=endpoint)
        local = look.run(picture=source, backend=vb)
        assert remote["answer"] == local["answer"]
        assert remote["animal"] == local["animal"]
        r, l_ = (x.get_meta_info("animal")["input_token_logprobs"] for x in (remote, local))
        assert [[e[1] for e in c] for c in r] == [[e[1] for e in c] for c in l_]
        for rc, lc in zip(r, l_):
            assert [e[0] for e in rc] == pytest.approx([e[0] for e in lc], abs=1e-5)
