"""Programs of the kinds SGLang users write, on braid's Engine backend with SmolLM2, greedy:
outputs are compared with the runtime's own greedy output for the same text (itself held to
transformers by the runtime tests) or with transformers directly."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import time

import jsonschema
import pytest
import torch

import braid as sgl
from braid import SamplingParams
from braid.lang.interpreter import UnknownVariable
from tests.conftest import assert_kv_all_free_or_cached


def greedy_text(llm, prompt: str, max_tokens: int, stop=None) -> str:
    p = SamplingParams(temperature=0, max_tokens=max_tokens, stop=stop)
    return llm.generate(prompt, p, use_tqdm=False)[0].outputs[0].text


FEW_SHOT = (
    "Q: What is the capital of Italy?\nA: Rome\n\n"
    "Q: What is the capital of Spain?\nA: Madrid\n\n"
    "Q: What is the capital of Japan?\nA: Tokyo\n\n"
)


@sgl.function
def few_shot_qa(s, question):
    s += FEW_SHOT
    s += "Q: " + question + "\nA:"
    s += sgl.gen("answer", max_tokens=8, stop="\n", temperature=0)


def test_few_shot_qa_matches_plain_generation(smollm2, backend):
    state = few_shot_qa.run(question="What is the capital of France?", backend=backend)
    prompt = FEW_SHOT + "Q: What is the capital of France?\nA:"
    assert state["answer"] == greedy_text(smollm2, prompt, 8, stop="\n")
    assert state.text() == prompt + state["answer"]
    meta = state.get_meta_info("answer")
    assert meta["prompt_tokens"] == len(smollm2.tokenizer.encode(prompt))
    assert meta["completion_tokens"] >= 1 and meta["finish_reason"]["type"] in ("stop", "length")


@sgl.function
def chat(s, first, second):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(first)
    with s.assistant():
        s += sgl.gen("a1", max_tokens=12, temperature=0)
    with s.user():
        s += second
    s += sgl.assistant(sgl.gen("a2", max_tokens=12, temperature=0))


def test_multi_turn_chat_renders_like_the_chat_template(smollm2, backend):
    state = chat.run(first="Name a fruit.", second="Name another one.", backend=backend)
    msgs = state.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[2]["content"] == state["a1"] and msgs[4]["content"] == state["a2"]
    # The program's text is exactly what the model's chat template renders for its messages.
    assert state.text() == smollm2.tokenizer.apply_chat_template(msgs, tokenize=False)
    # The first answer is what LLM.chat gives for the same conversation.
    first = smollm2.chat(msgs[:2], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert state["a1"] == first[0].outputs[0].text


@sgl.function
def pick_city(s, question, method=sgl.token_length_normalized):
    s += "You answer geography questions with one word.\n" * 4
    s += "Question: " + question + "\nAnswer:"
    s += sgl.select(
        "city", choices=[" Paris", " London", " Berlin", " Madrid"], choices_method=method
    )


def hf_choice_logprobs(hf, tok, prefix: str, choice: str) -> list[float]:
    p = tok.encode(prefix)
    full = tok.encode(prefix + choice)
    start = next((i for i, (a, b) in enumerate(zip(p, full)) if a != b), len(p))
    with torch.no_grad():
        logits = hf(torch.tensor([full])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [lp[i - 1, full[i]].item() for i in range(start, len(full))]


def test_select_scores_match_transformers_and_share_the_prefix(smollm2, hf_smollm2, backend):
    smollm2.flush_cache()
    before = smollm2.stats()
    state = pick_city.run(question="What is the capital of France?", backend=backend)
    after = smollm2.stats()
    meta = state.get_meta_info("city")
    prefix = "You answer geography questions with one word.\n" * 4
    prefix += "Question: What is the capital of France?\nAnswer:"
    choices = [" Paris", " London", " Berlin", " Madrid"]
    ref = [hf_choice_logprobs(hf_smollm2, smollm2.tokenizer, prefix, c) for c in choices]
    got_lps = [[t[0] for t in toks] for toks in meta["input_token_logprobs"]]
    for got, want in zip(got_lps, ref):
        assert got == pytest.approx(want, abs=2e-3)
    assert meta["normalized_prompt_logprobs"] == pytest.approx(
        [sum(r) / len(r) for r in ref], abs=2e-3
    )
    means = [sum(r) / len(r) for r in ref]
    assert state["city"] == choices[max(range(4), key=lambda i: means[i])]
    # One batched request: the shared prefix is computed once, not once per choice.
    computed = after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
    n_prefix = len(smollm2.tokenizer.encode(prefix))
    assert computed < n_prefix + 4 * 4, (computed, n_prefix)


@pytest.mark.parametrize(
    "method", [sgl.greedy_token_selection, sgl.unconditional_likelihood_normalized]
)
def test_other_choice_methods_choose_a_choice(backend, method):
    state = pick_city.run(question="What is the capital of France?", method=method, backend=backend)
    assert state["city"] in (" Paris", " London", " Berlin", " Madrid")
    assert len(state.get_meta_info("city")["scores"]) == 4


@sgl.function
def typed(s):
    s += "Alice is 31 years old. Her age in years is "
    s += sgl.gen_int("age", max_tokens=4)
    s += ".\nIs Alice an adult (True or False)? "
    s += sgl.gen("adult", dtype=bool, max_tokens=3)
    s += "\nHer height in metres: "
    s += sgl.gen("height", dtype=float, max_tokens=6)
    s += "\nHer name in quotes: "
    s += sgl.gen_string("name", max_tokens=8)


def test_typed_gens_keep_text_and_give_python_values(backend):
    state = typed.run(backend=backend, temperature=0)
    # As in SGLang, a variable is the generated text; get_value converts a typed one.
    for name, kind in (("age", int), ("adult", bool), ("height", float), ("name", str)):
        assert isinstance(state[name], str), name
        assert isinstance(state.get_value(name), kind), name
    assert state.get_value("age") == int(state["age"])
    assert "Her age in years is " + state["age"] + "." in state.text()
    assert state["name"] == '"' + state.get_value("name") + '"'
    assert re.fullmatch(r'"[^"]*"', state.text().rsplit("quotes: ", 1)[1])


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@sgl.function
def structured(s):
    s += "A person as JSON: "
    s += sgl.gen("person", json_schema=PERSON, max_tokens=40, temperature=0)
    s += "\nA date (YYYY-MM-DD): "
    s += sgl.gen("date", regex=r"\d{4}-\d{2}-\d{2}", max_tokens=12, temperature=0)


def test_regex_and_json_schema_gens_are_valid(backend):
    state = structured.run(backend=backend)
    jsonschema.validate(json.loads(state["person"]), PERSON)
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", state["date"])


TOOLS = {"calculate": lambda arg: str(eval(arg, {"__builtins__": {}})), "finish": None}


@sgl.function
def react(s, question, max_steps=3):
    s += "Answer by using tools. Tools: calculate, finish.\n"
    s += "Question: " + question + "\n"
    for step in range(max_steps):
        s += f"Action {step}:"
        s += sgl.select(f"action{step}", choices=[" calculate", " finish"])
        if s[f"action{step}"] == " finish":
            break
        s += " Input:"
        s += sgl.gen(f"input{step}", regex=r" [0-9]{1,3} ?[+*-] ?[0-9]{1,3}", max_tokens=10)
        result = TOOLS["calculate"](s[f"input{step}"])
        s += "\nObservation: " + result + "\n"


def test_react_tool_loop_calls_python_and_appends_results(backend):
    state = react.run(question="What is 12 * 7?", backend=backend, temperature=0)
    steps = [k for k in ("action0", "action1", "action2") if k in state]
    assert steps and all(state[k] in (" calculate", " finish") for k in steps)
    for k in steps:
        if state[k] == " calculate":
            i = k[-1]
            expr = state[f"input{i}"]
            assert f"Observation: {eval(expr, {'__builtins__': {}})}\n" in state.text()
    again = react.run(question="What is 12 * 7?", backend=backend, temperature=0)
    assert again.text() == state.text()  # deterministic under greedy


@sgl.function
def skeleton(s, topic, mode="gather_variable"):
    s += "Write three short tips about " + topic + ".\n"
    forks = s.fork(3)
    forks += lambda i: f"Tip {i + 1}:"
    forks += sgl.gen("tip", max_tokens=8, stop="\n", temperature=0)
    forks.join(mode)


def test_fork_join_branches_equal_independent_generations(smollm2, backend):
    state = skeleton.run(topic="sleep", backend=backend)
    tips = state["tip"]
    assert isinstance(tips, list) and len(tips) == 3
    base = "Write three short tips about sleep.\n"
    for i, tip in enumerate(tips):
        assert tip == greedy_text(smollm2, base + f"Tip {i + 1}:", 8, stop="\n")
    joined = skeleton.run(topic="sleep", mode="concate_and_append", backend=backend)
    assert joined.text() == base + "".join(f"Tip {i + 1}:{t}" for i, t in enumerate(tips))


def test_streaming_text_iter_reassembles_the_text(backend):
    state = few_shot_qa.run(question="What is the capital of Peru?", stream=True, backend=backend)
    pieces = list(state.text_iter())
    assert "".join(pieces) == state.text()
    assert len(pieces) >= 3  # constant text, then the generation in more than one piece
    state = few_shot_qa.run(question="What is the capital of Peru?", stream=True, backend=backend)
    assert "".join(state.text_iter("answer")) == state["answer"]

    async def collect():
        st = few_shot_qa.run(question="What is the capital of Chile?", stream=True, backend=backend)
        return st, [x async for x in st.text_async_iter("answer", return_meta_data=True)]

    st, items = asyncio.run(collect())
    assert "".join(p for p, _ in items) == st["answer"]
    counts = [m["completion_tokens"] for _, m in items]
    assert counts == sorted(counts) and counts[-1] >= 1


@sgl.function
def thinks_between_gens(s):
    s += "Q: 1 + 1 =\nA:"
    s += sgl.gen("first", max_tokens=3, stop="\n", temperature=0)
    first = s["first"]  # the program waits for its own gen, then does Python work
    time.sleep(0.5)
    s += "\nQ: " + first.strip() + " + 1 =\nA:"
    s += sgl.gen("second", max_tokens=3, stop="\n", temperature=0)


def test_reads_of_a_streamed_run_wait_for_what_its_body_will_queue(backend):
    """Reading a streamed run's variable from the caller waits for the program body, which runs
    in its own thread and may not have queued the gen that sets the name yet (it was a
    'not set by this program' error while the body was still working). A name the program
    never sets is still an error, once the body has ended."""
    whole = thinks_between_gens.run(backend=backend)
    state = thinks_between_gens.run(stream=True, backend=backend)
    assert state["second"] == whole["second"]
    assert state.error() is None and state.text() == whole.text()
    state = thinks_between_gens.run(stream=True, backend=backend)
    with pytest.raises(UnknownVariable, match="'third' is not set"):
        state["third"]


@sgl.function
def forks_and_threads(s):
    s += "Q: Name two colours.\nA:"
    forks = s.fork(2)
    forks += sgl.gen("colour", max_tokens=3, stop="\n", temperature=0)
    forks.join()
    with s.copy() as c:
        c += sgl.gen("more", max_tokens=2, temperature=0)
    # The program reads its own state from a thread of its own, and waits for it.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        s["seen"] = pool.submit(lambda: s["colour"]).result(timeout=60)


def test_a_streamed_run_joins_its_forks_and_its_threads_read_its_state(backend):
    """Only the caller's reads wait for a streamed body: a join (run by the state's own worker)
    and a thread the body waits for read as in a run that is not streamed."""
    whole = forks_and_threads.run(backend=backend)
    state = forks_and_threads.run(stream=True, backend=backend)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        text = pool.submit(lambda: "".join(state.text_iter())).result(timeout=120)
    assert text == whole.text() and state["seen"] == whole["colour"] == whole["seen"]


def test_run_batch_equals_single_runs_in_order(smollm2, backend):
    questions = [
        f"What is the capital of {c}?"
        for c in ("France", "Germany", "Egypt", "Canada", "Kenya", "Chile", "India", "Peru")
    ]
    smollm2.flush_cache()
    states = few_shot_qa.run_batch([{"question": q} for q in questions], backend=backend)
    for q, st in zip(questions, states):
        assert st["answer"] == few_shot_qa.run(question=q, backend=backend)["answer"]
    # The shared few-shot prefix was sent once before the batch: every program hit it.
    n_prefix = len(smollm2.tokenizer.encode(FEW_SHOT)) - 2
    assert all(st.get_meta_info("answer")["cached_tokens"] >= n_prefix for st in states)


def test_trace_graph_shape():
    g = skeleton.trace()
    kinds = [n.kind for n in g.nodes]
    assert kinds[:4] == ["text", "arg", "text", "fork"]
    assert g.count("gen") == 3 and g.count("fork") == 1 and g.count("join") == 1
    fork = g.of_kind("fork")[0]
    join = g.of_kind("join")[0]
    assert len(g.successors(fork.id)) == 3  # one edge into each branch
    assert len(g.predecessors(join.id)) == 3  # each branch's gen flows into the join
    assert {n.branch for n in g.of_kind("gen")} == {(0,), (1,), (2,)}
    assert "fork n=3" in str(g)
    chat_graph = chat.trace(first="hi")
    assert chat_graph.count("role_begin") == 5 and chat_graph.count("gen") == 2
    assert [n.kind for n in chat_graph.nodes].count("arg") == 1  # `second` unknown, `first` given


def test_untraceable_argument_fails_loudly():
    @sgl.function
    def fstring(s, name):
        s += f"Hello {name}"

    with pytest.raises(sgl.TraceError, match=r"argument 'name' .* f-string.*s \+= name"):
        fstring.trace()
    assert fstring.trace(name="Bob").nodes[0].node.value == "Hello Bob"


def test_a_program_run_inside_a_trace_stops_the_trace_and_runs_nothing(backend):
    """A program that runs a program: tracing it stops at the inner run (TraceError) without
    running it, its constant prefix is the text before, and a program that runs itself
    finishes (its first run's pre-computing of the prefix does not wait on itself)."""
    ran = []

    @sgl.function
    def helper(s):
        ran.append("helper")
        s += "hi"

    @sgl.function
    def outer(s, q):
        s += "System prompt. "
        helper.run(backend=backend)
        s += q

    with pytest.raises(sgl.TraceError, match="helper.run inside a trace"):
        outer.trace()
    assert outer.constant_prefix(backend, {"q"}) == "System prompt. "
    assert ran == []

    @sgl.function
    def recursive(s, q, depth=0):
        s += "Think step by step. "
        if depth < 1:  # the inner run happens while the outer's prefix is pre-computed
            ran.append(recursive.run(q="inner", depth=depth + 1, backend=backend).text())
        s += q

    state = recursive.run(q="outer", backend=backend)
    assert state.text() == "Think step by step. outer"
    assert ran == ["Think step by step. inner"]


def test_unknown_variable_is_a_clear_error(backend):
    @sgl.function
    def reads_missing(s):
        s += "Hi"
        s += sgl.gen("x", max_tokens=2, temperature=0)
        s["y"]

    with pytest.raises(UnknownVariable, match=r"'y' is not set.*\['x'\]"):
        reads_missing.run(backend=backend)


def test_failing_step_names_the_program_line(smollm2, backend):
    @sgl.function
    def bad(s):
        s += "Hi"
        s += sgl.gen("x", min_tokens=4)  # more than the run's max_tokens: known only when run

    with pytest.raises(sgl.ProgramError, match=r"test_programs.py:\d+ in bad: .*min_tokens=4"):
        bad.run(backend=backend, max_tokens=2)
    assert_kv_all_free_or_cached(smollm2)


def test_image_on_a_text_only_model_is_a_clear_error(backend):
    @sgl.function
    def look(s):
        s += sgl.user(sgl.image(b"\x89PNG fake") + "What is this?")
        s += sgl.assistant(sgl.gen("x", max_tokens=4))

    with pytest.raises(sgl.ProgramError, match="takes text only"):
        look.run(backend=backend)


def test_unreachable_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="no braid server answers at http://127.0.0.1:9"):
        sgl.RuntimeEndpoint("http://127.0.0.1:9")


def test_no_backend_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(sgl.global_config, "_default_backend", None)
    with pytest.raises(ValueError, match="set_default_backend"):
        few_shot_qa.run(question="x")


def test_default_backend_and_direct_call(smollm2):
    sgl.set_default_backend(smollm2)
    state = few_shot_qa(question="What is the capital of France?")
    assert state["answer"] == few_shot_qa.run(question="What is the capital of France?")["answer"]


def test_bad_arguments_raise_value_errors():
    with pytest.raises(ValueError, match="unknown sampling argument"):
        sgl.gen("x", max_tokenz=3)
    with pytest.raises(ValueError, match="choices must be a non-empty list"):
        sgl.select("x", choices=[])
    with pytest.raises(ValueError, match="regex"):
        sgl.gen("x", regex="(")

    @sgl.function
    def appends(s, x):
        s += x

    with pytest.raises(ValueError, match="cannot append a list"):
        appends.trace(x=["not", "text"])


def test_return_logprob_meta_info(backend):
    @sgl.function
    def scored(s):
        s += FEW_SHOT + "Q: What is the capital of Peru?\nA:"
        s += sgl.gen("a", max_tokens=4, temperature=0, return_logprob=True)

    state = scored.run(backend=backend)
    meta = state.get_meta_info("a")
    lps = meta["output_token_logprobs"]
    assert len(lps) == meta["completion_tokens"] >= 1
    assert all(lp <= 0 and isinstance(tid, int) for lp, tid, _ in lps)
    assert "".join(text for _, _, text in lps) == state["a"]


def test_a_read_waits_for_the_queued_gen_that_sets_the_name_again(backend):
    """A loop that reuses a variable name reads each turn's value, not the first one's (SGLang
    waits for the newest gen of a name); so does a read after set_var then gen of that name."""

    @sgl.function
    def turns(s):
        seen = []
        for q in ("The capital of France is", "\nOne, two, three,", "\nRed, green,"):
            s += q
            s += sgl.gen("answer", max_tokens=3, temperature=0, ignore_eos=True)
            seen.append(s["answer"])
        s["x"] = "manual"
        s += sgl.gen("x", max_tokens=2, temperature=0)
        seen.append(s["x"])
        for i in range(2):
            with s.var_scope("scope"):
                s += f" step{i}"
            seen.append(s["scope"])
        return seen

    state = turns.run(backend=backend)
    answers = state.ret_value[:3]
    assert len(set(answers)) == 3  # three turns' answers, not the first one three times
    text = state.text()
    assert all(text.index(q) < text.index(a) for q, a in zip(["France", "three", "green"], answers))
    assert state.ret_value[3] != "manual" and state.ret_value[3] in state.text()
    assert state.ret_value[4:] == [" step0", " step1"]


def test_meta_info_and_typed_values_of_every_kind_of_variable(backend):
    """get_meta_info is None for a variable no gen set (var_scope, set_var), as SGLang's; a
    join gathers each branch's meta info and typed values beside their texts."""

    @sgl.function
    def prog(s):
        s += "Count: 1, 2, "
        with s.var_scope("scope"):
            s += "3"
        s["manual"] = 5
        forks = s.fork(2)
        for f in forks:
            f += sgl.gen_int("n", max_tokens=2)
        forks.join()

    state = prog.run(backend=backend)
    assert state.get_meta_info("scope") is None and state.get_meta_info("manual") is None
    metas = state.get_meta_info("n")
    assert len(metas) == 2 and all(m["completion_tokens"] >= 1 for m in metas)
    texts = state["n"]
    assert state.get_value("n") == [int(t) for t in texts]
    with pytest.raises(UnknownVariable):
        state.get_meta_info("nothing")


def test_a_run_seed_makes_a_sampled_select_repeat(backend):
    @sgl.function
    def pick(s):
        s += "My favourite fruit is"
        s += sgl.select("fruit", choices=[" apple", " banana", " cherry", " date"], temperature=5)

    picks = {pick.run(backend=backend, seed=123)["fruit"] for _ in range(6)}
    assert len(picks) == 1
    unseeded = {pick.run(backend=backend)["fruit"] for _ in range(12)}
    assert len(unseeded) > 1  # at temperature 5 the four choices are all likely


def test_errors_inside_a_with_role_block_name_the_program_line(backend):
    @sgl.function
    def nested(s):
        with s.user():
            s += "Hi"
            with s.assistant():
                s += "there"

    with pytest.raises(sgl.ProgramError, match=r"test_programs.py:\d+ in nested: with s\.assist"):
        nested.run(backend=backend)


def test_a_regex_the_grammar_backend_cannot_compile_is_a_value_error(smollm2, backend):
    @sgl.function
    def word(s):
        s += "Say cat:"
        s += sgl.gen("w", max_tokens=3, regex=r"\bcat\b")

    with pytest.raises(sgl.ProgramError) as info:
        word.run(backend=backend)
    assert isinstance(info.value.__cause__, ValueError)
    assert "cannot be compiled" in str(info.value)
    assert_kv_all_free_or_cached(smollm2)


def test_a_join_gathers_a_branchs_value_that_equals_the_parents(backend):
    """What a branch set is gathered even where it equals the parent's value from before the
    fork: the same select choice, a one-character or an empty gen (CPython shares such
    strings, and a check by identity took them for the parent's: None, or no list)."""

    @sgl.function
    def prog(s):
        s += "Is the sky blue? Answer:"
        s += sgl.select("ans", choices=[" yes"])
        s += sgl.gen("d", max_tokens=1, regex="7") + sgl.gen("e", max_tokens=0)
        forks = s.fork(2)
        forks += "\nIs the sky blue? Answer:"
        forks[0] += sgl.select("ans", choices=[" yes"])
        forks[1] += sgl.select("ans", choices=[" maybe"])
        forks += sgl.gen("d", max_tokens=1, regex="7")
        forks[0] += sgl.gen("e", max_tokens=0)
        forks.join()

    state = prog.run(backend=backend)
    assert state["ans"] == [" yes", " maybe"]
    assert all(m is not None for m in state.get_meta_info("ans"))
    assert state["d"] == ["7", "7"] and state["e"] == ["", None]


def test_a_join_gathers_only_what_each_branch_set_and_an_ended_state_takes_nothing(backend):
    """Branches that set a typed name again with untyped gens gather texts (no stale typed
    entry from before the fork); a branch that did not set a name gathers None; a fork member
    appended to after the join is a clear error, not a step that never runs."""

    @sgl.function
    def prog(s):
        s += "Count: 1, 2,"
        s += sgl.gen_int("n", max_tokens=2)
        forks = s.fork(2)
        forks[0] += sgl.gen("n", max_tokens=2, temperature=0)
        forks[1] += sgl.gen("other", max_tokens=1, temperature=0)
        forks.join()
        s.after = forks[0]

    state = prog.run(backend=backend)
    texts = state["n"]
    assert texts[1] is None and isinstance(texts[0], str)
    assert state.get_value("n") == texts  # untyped: the texts as they are
    assert state.get_meta_info("n")[1] is None
    assert state["other"][0] is None
    with pytest.raises(sgl.ProgramError, match="has ended"):
        state.after += sgl.gen("x", max_tokens=1)
