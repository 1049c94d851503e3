"""Every grammar backend over SmolLM2's vocabulary, without a model: each accepts what its
constraint allows and refuses what it does not (JSON schemas of the corpus, regexes, choices,
EBNF, Lark, structural tags); a constraint a backend cannot enforce goes to one that can, or is
a `ValueError` naming the keyword; bad grammars are `ValueError`s naming the field; a
constraint that admits no output is found when compiling or at its grammar's first step, by
every backend, and never compiled into one that admits some; a grammar's error mid-generation is
one short line; SGLang's character regex compiles in well under a second."""

from __future__ import annotations

import json
import time

import psutil
import pytest

from braid import SamplingParams
from braid.runtime.config import DEFAULT_GRAMMAR_BACKENDS
from braid.runtime.constrained import grammar_backend_names
from braid.runtime.constrained.grammar import (
    MAX_ERROR_CHARS,
    NO_OUTPUT,
    GrammarCompiler,
    short_error,
    start_refusal,
)
from braid.runtime.constrained.outlines_backend import SUPPORT as OUTLINES
from braid.runtime.constrained.schema_support import closed_objects, unenforced
from braid.runtime.constrained.spec import check_spec
from braid.runtime.constrained.xgrammar_backend import SUPPORT as XGRAMMAR
from braid.runtime.constrained.xgrammar_backend import compile_spec, dot_excludes_newline
from braid.runtime.tokenizer.tokenizer import load_tokenizer
from tests.runtime.grammars import (
    ARITHMETIC,
    CHARACTER,
    CHARACTER_REGEX,
    INSTANCES,
    SQL,
    SQL_LARK,
    TOOL_TAG,
)
from tests.runtime.json_schemas import CORPUS

BACKENDS = grammar_backend_names()


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def compilers(tok):
    return {b: GrammarCompiler(tok, b) for b in BACKENDS}


def walk(compiler: GrammarCompiler, kind: str, spec, text: str) -> tuple[bool, bool]:
    """(every token of `text` is accepted, the grammar may end after it)."""
    m = compiler.compile(kind, spec).matcher()
    for t in compiler.vocab.encode(text):
        try:
            m.advance(t)
        except ValueError:
            return False, False
    return True, m.is_final


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_corpus_schema_takes_its_instance_and_refuses_others(compilers, backend):
    c = compilers[backend]
    for name, schema in CORPUS.items():
        assert walk(c, "json_schema", schema, json.dumps(INSTANCES[name])) == (True, True), name
    refused = {
        "flat": '{"a": 3}',
        "enum": '"huge"',
        "int_bounds": "300",
        "pattern": '"AB-12"',
        "array_bounds": '["x"]',
        "const": '{"v": 2}',
        "string_length": '"abcdefg"',
    }
    for name, text in refused.items():
        assert walk(c, "json_schema", CORPUS[name], text) != (True, True), (name, text)


@pytest.mark.parametrize("backend", BACKENDS)
def test_regexes_and_choices(compilers, backend):
    c = compilers[backend]
    assert walk(c, "regex", r" [12][0-9]{3}", " 1999") == (True, True)
    assert walk(c, "regex", r" [12][0-9]{3}", " 3999")[0] is False
    assert walk(c, "regex", r" (yes|no)", " maybe")[0] is False
    fruit = ["apple", "banana", "cherry pie", "a.b*c"]  # metacharacters are literal
    assert all(walk(c, "choice", fruit, f) == (True, True) for f in fruit)
    assert walk(c, "choice", fruit, "cherry")[1] is False
    assert walk(c, "choice", fruit, "aXb")[0] is False


def test_integer_bounds_are_enforced_by_whichever_backend_compiles_them(compilers):
    qty = {"type": "integer", "minimum": 1, "maximum": 9}
    bounded = {"type": "object", "properties": {"qty": qty}, "required": ["qty"]}
    for backend, c in compilers.items():
        grammar = c.compile("json_schema", bounded)
        # outlines-core would write an unbounded integer: the schema goes to llguidance.
        assert grammar.backend == ("llguidance" if backend == "outlines" else backend)
        assert walk(c, "json_schema", bounded, '{"qty": 7}') == (True, True)
        assert walk(c, "json_schema", bounded, '{"qty": 300}')[1] is False
        assert walk(c, "json_schema", bounded, '{"qty": 0')[1] is False
    why = compilers["outlines"].get_backend("outlines").refusal("json_schema", json.dumps(bounded))
    assert "'minimum' (at /properties/qty) is not enforced by the outlines backend" in why


def test_ebnf_grammars(compilers):
    for backend, c in compilers.items():
        assert c.compile("ebnf", ARITHMETIC).backend != "outlines"
        for text in ("12 + 7 = 19", "3 * 4 = 12"):
            assert walk(c, "ebnf", ARITHMETIC, text) == (True, True), (backend, text)
        assert walk(c, "ebnf", ARITHMETIC, "12 + + 7")[0] is False
        assert walk(c, "ebnf", ARITHMETIC, "12 + 7")[1] is False
        for text in ("SELECT name FROM users;", "SELECT id, age FROM orders WHERE age > 30;"):
            assert walk(c, "ebnf", SQL, text) == (True, True), (backend, text)
        assert walk(c, "ebnf", SQL, "SELECT name FROM students;")[0] is False
        assert walk(c, "ebnf", SQL, "DROP TABLE users;")[0] is False


def test_lark_grammars_go_to_llguidance(compilers):
    for c in compilers.values():
        assert c.compile("lark", SQL_LARK).backend == "llguidance"
        assert walk(c, "lark", SQL_LARK, "SELECT name FROM users;") == (True, True)
        assert walk(c, "lark", SQL_LARK, "SELECT name FROM users")[1] is False


def test_structural_tags_constrain_only_inside_the_tags(compilers):
    call = '<function=get_weather>{"city": "Paris"}</function>'
    wrong = 'Hm <function=get_weather>{"town": 1}'
    for c in compilers.values():
        assert c.compile("structural_tag", TOOL_TAG).backend != "outlines"
        assert walk(c, "structural_tag", TOOL_TAG, "Free text, any words.") == (True, True)
        assert walk(c, "structural_tag", TOOL_TAG, f"Let me check. {call} Done.") == (True, True)
        assert walk(c, "structural_tag", TOOL_TAG, wrong)[0] is False
        assert walk(c, "structural_tag", TOOL_TAG, "<function=get_time>{}")[0] is False
        # Inside a tag the text is not free: a tag left open may not end there.
        assert walk(c, "structural_tag", TOOL_TAG, '<function=get_weather>{"city": "P')[1] is False


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_grammars_and_unenforceable_schemas_are_value_errors_naming_them(compilers, backend):
    c = compilers[backend]
    with pytest.raises(ValueError, match="^ebnf: "):
        c.compile("ebnf", 'root ::= "a" undefined_rule')
    with pytest.raises(ValueError, match="^lark: "):
        c.compile("lark", "start: (")
    with pytest.raises(ValueError, match="^json_schema: .*uniqueItems"):
        c.compile("json_schema", {"type": "array", "uniqueItems": True})
    with pytest.raises(ValueError, match="^json_schema: .*not"):
        c.compile("json_schema", {"not": {"type": "string"}})
    with pytest.raises(ValueError, match="^json_schema: .*format.*idn-email"):
        c.compile("json_schema", {"type": "string", "format": "idn-email"})


def test_sglang_character_regex_compiles_in_well_under_a_second(compilers):
    c = compilers[DEFAULT_GRAMMAR_BACKENDS["cpu"]]
    # CPU time, which a busy neighbour (the suite runs in two workers) does not stretch.
    t0 = time.process_time()
    c.compile("regex", CHARACTER_REGEX)
    assert time.process_time() - t0 < 1.0
    assert walk(c, "regex", CHARACTER_REGEX, CHARACTER) == (True, True)
    assert walk(compilers["xgrammar"], "regex", CHARACTER_REGEX, CHARACTER) == (True, True)


def test_sampling_params_check_what_no_backend_is_needed_for():
    for kw, field in [
        (dict(ebnf=""), "ebnf"),
        (dict(structural_tag={"structures": [], "triggers": ["<f"]}), "structural_tag"),
        (
            dict(structural_tag={"structures": [{"begin": "<g>", "end": ""}], "triggers": ["<f"]}),
            "structural_tag.structures",
        ),
        (
            dict(structural_tag={"structures": [{"begin": "<f>", "end": ""}], "format": {}}),
            "structural_tag",
        ),
        (dict(ebnf="root ::= x", regex="a"), "ebnf: give only one of"),
        (dict(lark="start: x", json_schema={}), "lark: give only one of"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    sp = SamplingParams(structural_tag=json.dumps({"type": "structural_tag", **TOOL_TAG}))
    assert sp.constraint[0] == "structural_tag" and json.loads(sp.structural_tag) == TOOL_TAG


def test_what_xgrammar_would_skip_is_refused_before_and_while_compiling():
    import xgrammar as xgr

    both = {"allOf": [{"type": "integer"}, {"minimum": 3}]}
    assert "allOf of several schemas (at /)" in unenforced(both, XGRAMMAR)
    assert "multipleOf on a non-integer" in unenforced({"multipleOf": 0.5}, XGRAMMAR)
    assert unenforced({"type": "integer", "multipleOf": 3}, XGRAMMAR) is None
    # Past the check, xgrammar's own warning (it would accept any JSON) refuses the grammar.
    info = xgr.TokenizerInfo([b"a", b"1", b""], xgr.VocabType.RAW, stop_token_ids=[2])
    with pytest.raises(ValueError, match="^json_schema: xgrammar would not enforce all of it"):
        compile_spec(xgr.GrammarCompiler(info, max_threads=1), "json_schema", json.dumps(both))


def test_xgrammar_dot_excludes_a_newline_as_the_other_backends_do(compilers):
    for c in compilers.values():
        assert walk(c, "regex", "a.{2}b", "axyb") == (True, True)
        assert walk(c, "regex", "a.{2}b", "a\nxb")[0] is False
        assert walk(c, "regex", r"a\.b|a[.]c", "a.c") == (True, True)
        assert walk(c, "regex", r"a\.b|a[.]c", "axb")[0] is False
    assert dot_excludes_newline(r"a.\.[.].[^].]\\.") == r"a[^\n]\.[.][^\n][^].]\\[^\n]"


def test_ip_addresses_with_leading_zeros_are_refused_on_every_backend(compilers):
    ipv4 = {"type": "string", "format": "ipv4"}
    assert "format 'ipv4'" in unenforced(ipv4, XGRAMMAR)
    assert "format 'ipv6'" in unenforced({"type": "string", "format": "ipv6"}, XGRAMMAR)
    for c in compilers.values():
        assert walk(c, "json_schema", ipv4, '"176.83.39.49"') == (True, True)
        assert walk(c, "json_schema", ipv4, '"176.83.039.49"')[1] is False


def test_property_counts_on_an_object_open_to_other_keys_are_refused_by_every_backend(compilers):
    # llguidance and xgrammar wrote {"c": 2, "b": 10, "c": 2} for these: three members counted,
    # two properties parsed.
    counted = {"type": "object", "minProperties": 3, "maxProperties": 4}
    a = {"a": {"type": "integer"}}
    for opener in [
        {"properties": a, "additionalProperties": {"type": "integer"}},
        {"properties": a, "patternProperties": {"^[a-z]$": {"type": "integer"}}},
        {"propertyNames": {"pattern": "^[a-z]$"}},
        {"properties": a, "additionalProperties": True},
    ]:
        for c in compilers.values():
            with pytest.raises(ValueError, match="'minProperties' 3 .* a key may be written twice"):
                c.compile("json_schema", {**counted, **opener})
    nested = {"type": "array", "items": {"type": "object", "minProperties": 2}}
    with pytest.raises(ValueError, match="'minProperties' 2 \\(at /items\\) is not enforced"):
        compilers["llguidance"].compile("json_schema", nested)
    # What a key written twice cannot break is taken: an upper bound (fewer parse than were
    # counted) and a lower bound of 1, Pydantic's dict[str, str] = Field(max_length=5) and
    # Field(min_length=1).
    for taken in ({"maxProperties": 5}, {"minProperties": 1}):
        schema = {"type": "object", "additionalProperties": {"type": "string"}, **taken}
        compilers["llguidance"].compile("json_schema", schema)
    # Where the keys are the listed ones, each is written once, and the count holds.
    fixed = {**counted, "properties": {**a, "b": {}}, "minProperties": 2}
    for c in compilers.values():
        assert walk(c, "json_schema", fixed, '{"a": 1, "b": 2}') == (True, True)
        assert walk(c, "json_schema", fixed, '{"a": 1}')[1] is False


def test_closed_objects_narrow_and_keep_allof_schemas():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert schema == {"type": "object", "properties": {"a": {"type": "object", "properties": {}}}}
    keep = {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}}
    assert closed_objects(keep) == keep
    merged = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert closed_objects(merged) == merged


def test_an_object_requiring_a_key_outside_its_properties_is_left_open(compilers):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}
    assert closed_objects(schema) == schema
    for c in compilers.values():  # llguidance compiles it, for every configured backend
        assert c.compile("json_schema", schema).unsatisfiable is None
        assert walk(c, "json_schema", schema, '{"a": 1, "b": "x"}') == (True, True)
        assert walk(c, "json_schema", schema, '{"a": 1}')[1] is False


def test_objects_that_apply_to_one_instance_together_are_left_open(compilers):
    """A schema's properties and its anyOf branches' (or a $ref beside them) describe one
    object: closed one by one, each refused the other's keys and the schema was reported as
    matching no output."""
    kind = {"kind": {"type": "string", "maxLength": 5}}
    branches = [
        {"properties": {"x": {"type": "integer"}}, "required": ["x"]},
        {"properties": {"y": {"type": "boolean"}}, "required": ["y"]},
    ]
    extended = {"type": "object", "properties": kind, "required": ["kind"], "anyOf": branches}
    based = {
        "type": "object",
        "properties": kind,
        "required": ["kind"],
        "$ref": "#/$defs/base",
        "$defs": {"base": {"properties": {"x": {"type": "integer"}}, "required": ["x"]}},
    }
    keys = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "anyOf": [{"required": ["b"]}, {"required": ["c"]}],
    }
    for schema in (extended, based, keys):
        assert closed_objects(schema) == schema
    llg = compilers["llguidance"]
    for schema, good, bad in (
        (extended, '{"kind": "a", "x": 1}', '{"kind": "a"}'),
        (based, '{"kind": "a", "x": 1}', '{"kind": "a"}'),
        (keys, '{"a": 1, "c": 2}', '{"a": 1}'),
    ):
        assert llg.compile("json_schema", schema).unsatisfiable is None
        assert walk(llg, "json_schema", schema, good) == (True, True)
        assert walk(llg, "json_schema", schema, bad)[1] is False
    # Closed where no schema applied with it requires a key it does not list: "at least one
    # of a and b", and alternatives each (a union of two objects, and what lies inside them).
    one_of_two = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
    }
    assert closed_objects(one_of_two)["additionalProperties"] is False
    assert walk(llg, "json_schema", one_of_two, '{"b": 2}') == (True, True)
    assert walk(llg, "json_schema", one_of_two, '{"b": 2, "c": 3}')[0] is False
    union = {
        "anyOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}],
        "$defs": {
            "a": {"type": "object", "properties": {"a": {"properties": {"z": {}}}}},
            "b": {"type": "object", "properties": kind, "anyOf": [{"required": ["kind"]}]},
        },
    }
    closed = closed_objects(union)["$defs"]
    assert closed["a"]["additionalProperties"] is False
    assert closed["a"]["properties"]["a"]["additionalProperties"] is False
    assert closed["b"]["additionalProperties"] is False  # the key it requires, it lists
    assert walk(llg, "json_schema", union, '{"a": {"z": 1, "w": 2}}')[0] is False


# ---- how each backend compiles on the pool ---------------------------------------------------
def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_grammar_that_crashes_llguidance_fails_its_request_alone(tok):
    from braid.runtime.constrained.compile_pool import AsyncGrammarCompiler

    pool = AsyncGrammarCompiler(lambda: GrammarCompiler(tok, "llguidance"), workers=1)
    try:
        assert pool.submit("regex", "warm").result(timeout=60).backend == "llguidance"
        [worker] = pool.worker_pids
        # A light worker: llguidance without torch (torch alone is over 200 MB).
        assert psutil.Process(worker).memory_info().rss < 150 * 2**20
        # 2000 chained rules: llguidance's grammar check overflows its stack (SIGSEGV).
        chain = "\n".join(f'r{i}: "w" (/[a-z]+/ | r{i + 1})?' for i in range(2000))
        crash = pool.submit("lark", f'start: r0\n{chain}\nr2000: "end"')
        with pytest.raises(
            ValueError, match="^lark: .*llguidance compile worker was killed by SIGSEGV"
        ):
            crash.result(timeout=60)
        assert _gone(worker)
        assert pool.submit("lark", SQL_LARK).result(timeout=60) is not None  # a new worker
    finally:
        pool.shutdown()


def test_an_overrunning_xgrammar_compile_has_its_worker_killed(tok):
    from braid.runtime.constrained.compile_pool import AsyncGrammarCompiler, PendingGrammars

    pool = AsyncGrammarCompiler(lambda: GrammarCompiler(tok, "xgrammar"), workers=1)
    try:
        assert pool.submit("regex", "(yes|no)").result(timeout=120).backend == "xgrammar"
        [worker] = pool.worker_pids
        pending: PendingGrammars[str] = PendingGrammars(pool, timeout_s=1.0)
        pending.add("slow", "regex", "(.{1,300}){1,300}")  # seconds of mask-cache building
        deadline = time.monotonic() + 10  # the limit is enforced when polled
        ready, failed = pending.poll()
        while not (ready or failed) and time.monotonic() < deadline:
            pending.wait(0.05)
            ready, failed = pending.poll()
        assert not ready and failed and "timed out after 1 s" in failed[0][1]
        deadline = time.monotonic() + 10
        while not _gone(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(worker)
    finally:
        pool.shutdown()


def test_schemas_whose_parts_a_backend_would_write_alone_go_to_one_that_merges_them(compilers):
    # JSON Schema applies `anyOf` together with the keywords beside it, and a required key
    # whether or not `properties` lists it: outlines-core and xgrammar would write either the
    # properties or the anyOf alone (any JSON, for xgrammar), or an object without the key.
    either = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "anyOf": [{"required": ["a"]}],
    }
    unlisted = {"type": "object", "required": ["x"]}
    for backend in ("outlines", "xgrammar"):
        why = compilers[backend].get_backend(backend).refusal
        assert "anyOf beside 'properties' (at /)" in why("json_schema", json.dumps(either))
        assert "required key 'x' (at /) is not in properties" in why(
            "json_schema", json.dumps(unlisted)
        )
    for c in compilers.values():
        assert c.compile("json_schema", either).backend == "llguidance"
        assert walk(c, "json_schema", either, '{"a": 1}') == (True, True)
        assert walk(c, "json_schema", either, "{}")[1] is False
        assert walk(c, "json_schema", unlisted, '{"x": 1}') == (True, True)
        assert walk(c, "json_schema", unlisted, "{}")[1] is False


# Constraints that compile but that no output satisfies (each backend refuses some of them when
# compiling; what it compiles, its first step must refuse).
CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
UNSATISFIABLE = [
    ("json_schema", {"$ref": "#"}),
    ("json_schema", CYCLE),
    ("json_schema", {"anyOf": []}),  # xgrammar and outlines-core: only the empty output
    ("json_schema", {"enum": []}),
    ("json_schema", {"type": []}),
    ("regex", "[^\\x00-\\U0010FFFF]"),
    ("ebnf", 'root ::= root "a"'),
]
SATISFIABLE = [
    ("json_schema", {"type": "object"}),
    ("regex", "a|"),  # the empty output is allowed: not JSON, so no refusal
    ("ebnf", 'root ::= ""'),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_grammar_that_admits_no_output_is_refused_at_its_first_step(compilers, backend):
    c, built = compilers[backend], 0
    lib = c.get_backend(backend)
    for kind, spec in UNSATISFIABLE:
        checked = check_spec(kind, spec)
        if lib.refusal(kind, checked) is not None:
            continue
        try:
            grammar = lib.build(kind, checked)
        except ValueError:
            continue  # refused when compiling: a 400 as well
        built += 1
        why = start_refusal(grammar, c.vocab)
        assert why is not None and why.startswith(f"{kind}: {NO_OUTPUT}"), (kind, spec, why)
    assert built, "the backend compiled none of them: the test checks nothing"
    for kind, spec in SATISFIABLE:
        if lib.refusal(kind, check_spec(kind, spec)) is None:
            assert start_refusal(lib.build(kind, check_spec(kind, spec)), c.vocab) is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_backend_compiles_an_unsatisfiable_constraint_into_one_that_runs(compilers, backend):
    # Routed as a request's constraint is: either refused while compiling, saying so (no later
    # backend is asked: one would allow the empty output, or any value), or compiled with the
    # reason on the grammar, which the scheduler refuses before the request runs.
    c = compilers[backend]
    for kind, spec in UNSATISFIABLE:
        try:
            why = c.compile(kind, spec).unsatisfiable
        except ValueError as e:
            why = str(e)
        assert why is not None and why.startswith(f"{kind}: "), (kind, spec)
        assert NO_OUTPUT in why or "cannot be compiled" in why, (kind, spec, why)
    for kind, spec in SATISFIABLE:
        assert c.compile(kind, spec).unsatisfiable is None, (kind, spec)


def test_xgrammar_would_allow_any_value_for_an_empty_type_list(compilers):
    nested = {"type": "object", "properties": {"a": {"type": []}, "b": {"type": "integer"}}}
    why = compilers["xgrammar"].get_backend("xgrammar").refusal("json_schema", json.dumps(nested))
    assert "empty 'type' list (at /properties/a) is not enforced" in why
    for c in compilers.values():
        assert walk(c, "json_schema", nested, '{"a": 1}')[0] is False
        assert walk(c, "json_schema", nested, '{"b": 1}') == (True, True)


# What outlines-core writes wrongly (each seen in outputs that finished "stop"): a uri that ends
# the string early, a recursion cut off with a trailing comma, `{"x": }`, a pattern dropped
# beside a length bound, minItems dropped beside prefixItems.
NODE = {
    "type": "object",
    "properties": {
        "v": {"type": "integer"},
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
    },
    "required": ["v", "kids"],
}
OUTLINES_WRONG = {
    "uri": ({"type": "string", "format": "uri"}, "format 'uri'"),
    "email": ({"type": "string", "format": "email"}, "format 'email'"),
    "recursive": (
        {"properties": {"root": {"$ref": "#/$defs/node"}}, "$defs": {"node": NODE}},
        "'#/$defs/node' reaches itself",
    ),
    "empty_type": (
        {"type": "object", "properties": {"x": {"type": []}, "y": {"type": "integer"}}},
        "empty 'type' list (at /properties/x)",
    ),
    "pattern_length": (
        {"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 4},
        "'pattern' beside 'maxLength' (at /)",
    ),
    "prefix_min_items": (
        {"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "string"},
         "minItems": 3},
        "'prefixItems' beside 'minItems' (at /)",
    ),
}  # fmt: skip


def test_what_outlines_would_write_wrongly_goes_to_another_backend(compilers):
    c = compilers["outlines"]
    for name, (schema, why) in OUTLINES_WRONG.items():
        assert why in (unenforced(schema, OUTLINES) or ""), name
        assert c.compile("json_schema", schema).backend == "llguidance", name
    assert c.compile("json_schema", OUTLINES_WRONG["recursive"][0]).unsatisfiable is None
    ok = '{"root": {"v": 1, "kids": [{"v": 2, "kids": []}]}}'
    assert walk(c, "json_schema", OUTLINES_WRONG["recursive"][0], ok) == (True, True)
    assert walk(c, "json_schema", OUTLINES_WRONG["pattern_length"][0], '"ab1"')[0] is False
    assert walk(c, "json_schema", OUTLINES_WRONG["prefix_min_items"][0], "[1]")[1] is False
    # What stays with outlines-core: each keyword alone, and a $ref that does not recurse.
    kept = {
        "pattern": {"type": "string", "pattern": "^[a-z]{2,4}$"},
        "prefix": {"type": "array", "prefixItems": [{"type": "integer"}], "items": False},
        "ref": {
            "$defs": {"n": {"type": "integer"}},
            "type": "array",
            "items": {"$ref": "#/$defs/n"},
        },
        "date": {"type": "string", "format": "date"},
    }
    for name, schema in kept.items():
        assert unenforced(schema, OUTLINES) is None, name
        assert c.compile("json_schema", schema).backend == "outlines", name
    assert walk(c, "json_schema", kept["pattern"], '"ab1"')[0] is False
    assert walk(c, "json_schema", kept["ref"], '[1, "x"]')[0] is False


def test_a_grammar_failing_mid_generation_says_why_in_one_short_line(compilers):
    # llguidance bounds its parser's work a step; past it, its error carries a dump of the
    # parser's state and the grammar (tens of kB), which the request's error must not.
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}}
    m = compilers["llguidance"].compile("json_schema", wide).matcher()
    with pytest.raises(ValueError) as failed:
        for t in compilers["llguidance"].vocab.encode('{"p1": "x"}'):
            m.advance(t)
    why = str(failed.value)
    assert "not allowed by the grammar here (" in why and "max is" in why, why
    assert len(why) < MAX_ERROR_CHARS + 80 and "\n" not in why and "<state>" not in why, why


def test_short_error_is_one_line_of_at_most_the_cap():
    assert short_error("token 3 is not allowed\n  here") == "token 3 is not allowed here"
    long = short_error("x" * 10 + "\n" + "y " * 50_000)
    assert long.startswith("xxxxxxxxxx y y") and long.endswith(" (truncated)"), long[-40:]
    assert len(long) <= MAX_ERROR_CHARS + len(" (truncated)") and "\n" not in long


def test_strict_hermes_tools_hold_each_call_to_its_schema(compilers):
    """The structural tag strict tools get with tool_choice "auto" (hermes format): free text
    passes, a call of a tool with its parameters passes, a call with other arguments or of no
    tool is refused."""
    from braid.runtime.function_call.tools import ToolPlan
    from braid.runtime.sampling_params import SamplingParams

    weather = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}]
    tools[0]["function"]["strict"] = True
    plan = ToolPlan.resolve(tools, "auto", True, parser="hermes")
    tag = plan.sampling_params(SamplingParams()).structural_tag
    begin = '<tool_call>\n{"name": "get_weather", "arguments": '
    for c in compilers.values():
        assert walk(c, "structural_tag", tag, "Let me see.") == (True, True)
        call = begin + '{"city": "Oslo"}}\n</tool_call>'
        assert walk(c, "structural_tag", tag, "Sure. " + call) == (True, True)
        assert walk(c, "structural_tag", tag, begin + '{"town": "Oslo"}')[0] is False
        assert walk(c, "structural_tag", tag, '<tool_call>\n{"name": "other"')[0] is False
