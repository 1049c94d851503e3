"""Constrained decoding with every grammar backend: on the real SmolLM2 vocabulary every
finished output matches its regex, choice or JSON schema and unconstrained neighbours are
unaffected; on a tiny random model with its own byte-level BPE, every sampled output is a
prefix the grammar accepts; vocabularies (byte-level and SentencePiece-style) map to the right
bytes; bitmasks ban exactly the tokens they should."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jsonschema
import pytest
import torch

from braid import SamplingParams
from braid.runtime.constrained import grammar_backend_names
from braid.runtime.constrained.bitmask import (
    BitmaskBuffer,
    apply_token_bitmask,
    apply_token_bitmask_torch,
    bitmask_words,
)
from braid.runtime.constrained.grammar import GrammarCompiler
from braid.runtime.constrained.vocab import token_bytes, token_vocab
from braid.runtime.ipc.to_scheduler import GenerateReq
from tests.conftest import local_scheduler, run_to_end
from tests.runtime.tiny_tokenizers import build_sentencepiece_style, build_tiny_constrained_model

SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"}},
        "required": ["ok", "score"],
    },
]


BACKENDS = grammar_backend_names()


@pytest.fixture(scope="module")
def sched(smollm2_dir, smollm2):
    """SmolLM2 with the default grammar backend (tests/runtime/test_json_schema_corpus.py runs
    every backend on SmolLM2)."""
    return local_scheduler(smollm2_dir, smollm2.eos_token_ids, kv_tokens=4096)


def _run(sched, tok, prompt: str, params: SamplingParams) -> str:
    sched.handle(GenerateReq("c", tok.encode(prompt), params, 1))
    ids = run_to_end(sched)["c"]
    return tok.decode(ids, skip_special_tokens=True)


def test_vocabulary_maps_byte_level_tokens_back_to_bytes(smollm2):
    tok = smollm2.tokenizer
    eos, mapping = token_bytes(tok)
    assert eos == tok.eos_token_id and all(eos not in ids for ids in mapping.values())
    space_paris = tok.encode(" Paris", add_special_tokens=False)
    assert len(space_paris) == 1 and space_paris[0] in mapping[b" Paris"]
    assert b"\n" in mapping


def test_regex_and_choice_outputs_match(sched, smollm2):
    tok = smollm2.tokenizer
    out = _run(
        sched,
        tok,
        "Is the sky blue? Answer:",
        SamplingParams(temperature=0.0, max_tokens=10, regex=r" (yes|no)"),
    )
    assert re.fullmatch(r" (yes|no)", out)
    out = _run(
        sched,
        tok,
        "Pick a fruit:",
        SamplingParams(
            temperature=1.0, seed=4, max_tokens=10, choice=["apple", "banana", "cherry"]
        ),
    )
    assert out in ("apple", "banana", "cherry")
    out = _run(
        sched,
        tok,
        "The year is",
        SamplingParams(temperature=1.0, seed=2, max_tokens=8, regex=r" [12][0-9]{3}"),
    )
    assert re.fullmatch(r" [12][0-9]{3}", out)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "array", "enum", "bool-number"])
def test_json_schema_outputs_validate(sched, smollm2, schema):
    tok = smollm2.tokenizer
    out = _run(
        sched,
        tok,
        "Reply with JSON only.\n",
        SamplingParams(temperature=0.7, seed=5, max_tokens=60, json_schema=schema),
    )
    jsonschema.validate(json.loads(out), schema)


def test_free_requests_are_unaffected_by_constrained_neighbours(sched, smollm2):
    tok = smollm2.tokenizer
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    sched.handle(GenerateReq("alone", tok.encode("Once upon a time"), free, 0))
    alone = run_to_end(sched)["alone"]
    sched.handle(GenerateReq("free", tok.encode("Once upon a time"), free, 0))
    sched.handle(
        GenerateReq(
            "json",
            tok.encode("JSON:"),
            SamplingParams(temperature=0.0, max_tokens=30, json_schema=SCHEMAS[0]),
            0,
        )
    )
    got = run_to_end(sched)
    assert got["free"] == alone
    assert sched.grammar_compiler.misses >= 1 and sched.grammar_compiler.backend in BACKENDS


def test_bad_specs_are_value_errors_naming_the_field():
    for kw, field in [
        (dict(regex="(unclosed"), "regex"),
        (dict(json_schema="{not json"), "json_schema"),
        (dict(choice=[]), "choice"),
        (dict(regex="a", json_schema={"type": "string"}), "json_schema"),
        (dict(choice=["yes"], min_tokens=4), "min_tokens"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)


def test_engine_generates_valid_json_through_the_processes(smollm2):
    """The JSON validates and has no free whitespace: json.dumps's separators, the form
    vLLM's `disable_any_whitespace` asks for (taken, and the same output)."""
    schema = SCHEMAS[0]
    vllm_style = {"json": schema, "disable_any_whitespace": True}
    outs = smollm2.generate(
        ["Give me a person as JSON:"] * 2,
        [
            SamplingParams(temperature=0.0, max_tokens=60, json_schema=schema),
            SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=vllm_style),
        ],
        use_tqdm=False,
    )
    out = outs[0].outputs[0]
    jsonschema.validate(json.loads(out.text), schema)
    assert out.finish_reason == "stop"
    assert out.text == json.dumps(json.loads(out.text))
    assert outs[1].outputs[0].text == out.text


# ---- bitmasks ---------------------------------------------------------------------------------
def _reference_mask(logits, bitmask, indices):
    out = logits.clone()
    for i, row in enumerate(indices.tolist()):
        for t in range(logits.shape[1]):
            w, j = divmod(t, 32)
            allowed = w < bitmask.shape[1] and (int(bitmask[i, w]) >> j) & 1
            if not allowed:
                out[row, t] = float("-inf")
    return out


@pytest.mark.parametrize("apply", [apply_token_bitmask_torch, apply_token_bitmask])
@pytest.mark.parametrize("vocab,words", [(70, 3), (70, 2), (64, 3)])
def test_bitmask_bans_exactly_the_cleared_bits_of_the_chosen_rows(vocab, words, apply):
    g = torch.Generator().manual_seed(vocab + words)
    logits = torch.randn(5, vocab, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=g)
    bitmask[1] = -1  # all allowed
    bitmask[2, 0] = 1 << 3  # only token 3 in the first word
    indices = torch.tensor([4, 0, 2])
    want = _reference_mask(logits, bitmask, indices)
    got = logits.clone()
    apply(got, bitmask, indices)
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 3]], logits[[1, 3]])  # rows without a grammar untouched


def test_bitmask_rejects_bad_shapes():
    logits = torch.zeros(2, 40)
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask_torch(logits, torch.zeros(1, 2, dtype=torch.int64), torch.tensor([0]))
    with pytest.raises(ValueError, match="indices"):
        apply_token_bitmask_torch(
            logits, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0, 1])
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bitmask_on_cuda_matches_the_torch_version():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 49157, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (40, 1537), dtype=torch.int32, generator=g)
    indices = torch.randperm(64, generator=g)[:40]
    want = logits.clone()
    apply_token_bitmask_torch(want, bitmask, indices)
    got = logits.cuda()
    apply_token_bitmask(got, bitmask.cuda(), indices.cuda())
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_matcher_bitmask_is_its_allowed_token_list(smollm2, backend):
    compiler = GrammarCompiler(smollm2.tokenizer, backend)
    tok = smollm2.tokenizer
    grammar = compiler.compile("json_schema", SCHEMAS[0])
    assert grammar.backend == backend
    buf = BitmaskBuffer(bitmask_words(compiler.vocab.size), torch.device("cpu"))
    matchers = [grammar.matcher() for _ in range(3)]
    for t in tok.encode('{"name": "', add_special_tokens=False):
        matchers[1].advance(t)  # inside a string: almost every token
    for t in tok.encode('{"name": "Al", "age": 4', add_special_tokens=False):
        matchers[2].advance(t)  # digits, `}`, spaces
    mask, rows = buf.fill(matchers, [2, 0, 1])
    assert rows.tolist() == [2, 0, 1]
    for m, bits in zip(matchers, mask):
        ids = torch.arange(bits.numel() * 32)
        set_bits = ((bits[ids // 32] >> (ids % 32)) & 1).bool()
        assert set(ids[set_bits].tolist()) == set(m.allowed_tokens())
        assert max(m.allowed_tokens()) < compiler.vocab.size
    assert len(matchers[1].allowed_tokens()) > 40000 and len(matchers[2].allowed_tokens()) < 200


# ---- vocabularies -----------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_sentencepiece_vocabulary_maps_metaspace_and_byte_tokens_to_bytes(backend):
    sp = build_sentencepiece_style()
    ids = sp.get_vocab()
    eos, mapping = token_bytes(sp)
    assert eos == ids["</s>"]
    flat = {tid: raw for raw, tids in mapping.items() for tid in tids}
    assert ids["</s>"] not in flat and ids["<s>"] not in flat and ids["<unk>"] not in flat
    assert flat[ids["<0x0A>"]] == b"\n" and flat[ids["<0xE2>"]] == b"\xe2"
    assert flat[ids["▁hello"]] == b" hello" and flat[ids["▁"]] == b" "
    assert flat[ids["hello"]] == b"hello" and flat[ids["▁{"]] == b" {"
    vocab, _ = token_vocab(sp)
    assert vocab.spells_every_first_byte  # the 256 byte tokens
    assert vocab.byte_tokens[0x0A] == ids["<0x0A>"]
    # A newline in text is tokenized through byte fallback: the mapped bytes spell it back.
    enc = sp.encode("hello\nworld", add_special_tokens=False)
    assert b"".join(flat[t] for t in enc) == b" hello\nworld"  # Metaspace's leading space

    compiler = GrammarCompiler(sp, backend)
    start = compiler.compile("regex", r" hello\n[a-z]+").matcher().allowed_tokens()
    if backend == "llguidance":
        # It allows only the tokenizer's own tokens for text the grammar forces.
        assert start == [ids["▁hello"]]
    else:
        assert ids["▁hello"] in start and ids["▁"] in start and ids["<0x20>"] in start
    assert ids["hello"] not in start
    m = compiler.compile("regex", r" hello\n[a-z]+").matcher()
    for t in (ids["▁hello"], ids["<0x0A>"], ids["w"]):
        m.advance(t)
    assert m.is_final


def _copy_tokenizer(src: Path, dst: Path, config: dict) -> Path:
    """`src`'s tokenizer files in `dst`, with `config` merged into tokenizer_config.json."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.update(config)
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


def _v4_style(smollm2_dir: Path, path: Path) -> Path:
    """SmolLM2's tokenizer with its config as transformers 4 saved configs: the added tokens
    in `added_tokens_decoder` (which makes transformers ignore special_tokens_map.json; this
    one's EOS differs), `add_bos_token`, the chat tokens as additional special tokens and a
    model-specific `*_token` entry."""
    tok = json.loads((smollm2_dir / "tokenizer.json").read_text())
    added = {str(t.pop("id")): t for t in tok["added_tokens"]}
    config = {"added_tokens_decoder": added, "add_bos_token": False, "image_token": "<|im_end|>"}
    config["additional_special_tokens"] = [added["3"]["content"], added["4"]["content"]]
    _copy_tokenizer(smollm2_dir, path, config)
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return path


def _vocabulary_dirs(tmp_path, smollm2_dir):
    from tests.runtime.tiny_tokenizers import build_byte_level_bpe

    build_sentencepiece_style(tmp_path / "sp")
    bpe = build_byte_level_bpe(tmp_path / "bpe")
    return [smollm2_dir, _v4_style(smollm2_dir, tmp_path / "v4"), bpe, tmp_path / "sp"]


def test_the_schedulers_vocabulary_is_what_transformers_reads(tmp_path, smollm2_dir):
    """`load_vocabulary` (the scheduler's, without transformers) gives the grammar compiler
    what transformers' fast tokenizer gives: SmolLM2's byte-level BPE, the same with a
    transformers-4-style config, a tiny trained one and a SentencePiece-style one with byte
    fallback and named special tokens."""
    from braid.runtime.tokenizer.tokenizer import FastVocabulary, load_tokenizer, load_vocabulary

    texts = ['{"name": "Ann", "age": 4}', " héllo\n\tworld 😀", "</s> <s> <|endoftext|> x", "a  b"]
    for path in _vocabulary_dirs(tmp_path, smollm2_dir):
        fast, hf = load_vocabulary(path), load_tokenizer(path)
        assert isinstance(fast, FastVocabulary), path
        assert (fast.eos_token_id, len(fast)) == (hf.eos_token_id, len(hf)), path
        assert fast.all_special_ids == sorted(hf.all_special_ids), path
        assert set(fast.added_tokens_decoder) == set(hf.added_tokens_decoder), path
        got, got_map = token_vocab(fast)
        want, want_map = token_vocab(hf)
        assert got_map == want_map and got.token_bytes == want.token_bytes, path
        assert (got.eos_token_id, got.size, got.byte_tokens) == (
            want.eos_token_id,
            want.size,
            want.byte_tokens,
        ), path
        for text in texts:
            assert got.encode(text) == want.encode(text), (path, text)


def test_the_schedulers_vocabulary_loads_without_transformers(smollm2_dir):
    """The point of `load_vocabulary`: the scheduler builds its grammar compiler and compiles
    with the CPU's default backend without importing transformers (2-4 s of a start on the
    H200 machine), nor the fallback backends, which are imported only once the default refuses
    (xgrammar's import imports transformers: on CUDA, where xgrammar is the default, it is
    imported while the weights load)."""
    import subprocess
    import sys

    from braid.runtime.config import DEFAULT_GRAMMAR_BACKENDS

    backend = DEFAULT_GRAMMAR_BACKENDS["cpu"]

    code = (
        "import sys\n"
        "from braid.runtime.tokenizer.tokenizer import load_vocabulary\n"
        "from braid.runtime.constrained.grammar import GrammarCompiler\n"
        f"c = GrammarCompiler(load_vocabulary({str(smollm2_dir)!r}), {backend!r})\n"
        "c.compile('json_schema', '{\"type\": \"object\"}')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'xgrammar')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout[:500]


def test_a_vocabulary_transformers_would_change_is_left_to_transformers(tmp_path, smollm2_dir):
    """Where transformers would change what tokenizer.json says (add a special or added token,
    re-flag one, read a special_tokens_map.json, fix a Mistral regex) or no EOS is named,
    `load_vocabulary` loads transformers' tokenizer."""
    from braid.runtime.tokenizer.tokenizer import FastVocabulary, load_vocabulary

    first = json.loads((smollm2_dir / "tokenizer.json").read_text())["added_tokens"][0]
    changes = [
        {"pad_token": "<|not-a-token|>"},  # transformers adds it
        {"pad_token": "hello"},  # an ordinary token, which transformers makes an added one
        {"image_token": "hello"},  # model-specific special tokens count too
        {"eos_token": None},
        {"added_tokens_decoder": {"49152": {"content": "<|new|>", "special": True}}},
        {"added_tokens_decoder": {str(first["id"]): {**first, "lstrip": True}}},
        {"fix_mistral_regex": True},
    ]
    for n, change in enumerate(changes):
        path = _copy_tokenizer(smollm2_dir, tmp_path / str(n), change)
        assert not isinstance(load_vocabulary(path), FastVocabulary), change
    # No added_tokens_decoder: transformers reads special_tokens_map.json on top.
    path = _copy_tokenizer(smollm2_dir, tmp_path / "map", {})
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    assert not isinstance(load_vocabulary(path), FastVocabulary)


# ---- random models: every output is a prefix the grammar accepts ------------------------------
TINY_SPECS = [
    ("regex", r"(yes|no)"),
    ("regex", r"[0-9]{1,3}(\.[0-9]{2})?"),
    ("choice", ("apple", "banana", "cherry pie")),
    (
        "json_schema",
        json.dumps(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 6},
                    "ok": {"type": "boolean"},
                },
                "required": ["name", "ok"],
            }
        ),
    ),
    (
        "json_schema",
        json.dumps({"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}),
    ),
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_constrained_model(tmp_path_factory.mktemp("tiny-constrained"))


@pytest.fixture(scope="module", params=BACKENDS)
def tiny(request, tiny_model):
    path, eos = tiny_model
    sched = local_scheduler(path, frozenset({eos}), kv_tokens=2048, grammar_backend=request.param)
    return sched, eos


def _accepted_prefix(grammar, ids: list[int], eos: int) -> tuple[bool, bool]:
    """(every token is accepted in turn, the walk ends in a final state); a trailing EOS is
    checked as allowed where it stands."""
    m = grammar.matcher()
    for i, t in enumerate(ids):
        if t == eos:
            return i == len(ids) - 1 and m.is_final, True
        try:
            m.advance(t)
        except ValueError:
            return False, False
    return True, m.is_final


@pytest.mark.parametrize("jump_forward", [True, False], ids=["jump-forward", "token-by-token"])
def test_sampled_outputs_of_a_random_model_are_accepted_prefixes(tiny, jump_forward):
    sched, eos = tiny
    sched.grammars.jump_forward_enabled = jump_forward
    jumped_before = sched.stats.jump_forward_tokens
    kw = {"json_schema": "json_schema", "regex": "regex", "choice": "choice"}
    for n, (kind, spec) in enumerate(TINY_SPECS):
        for seed in range(4):
            params = SamplingParams(temperature=1.0, seed=seed, max_tokens=40, **{kw[kind]: spec})
            sched.handle(GenerateReq(f"{n}-{seed}", [7, 8, 9, n + 10], params, seed))
    ids: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    while sched.has_work:
        for out in sched.step():
            ids.setdefault(out.rid, []).extend(out.new_token_ids)
            if out.finish_reason:
                finish[out.rid] = out.finish_reason
        sched.check_invariants()
    assert len(finish) == len(TINY_SPECS) * 4
    stopped = 0
    for n, (kind, spec) in enumerate(TINY_SPECS):
        grammar = sched.grammar_compiler.compile(kind, spec)
        for seed in range(4):
            rid = f"{n}-{seed}"
            assert finish[rid] in ("stop", "length"), (rid, finish[rid])
            accepted, final = _accepted_prefix(grammar, ids[rid], eos)
            assert accepted, (rid, ids[rid])
            if finish[rid] == "stop":
                stopped += 1
                assert final, (rid, ids[rid])
    assert stopped >= 8  # the short grammars end
    jumped = sched.stats.jump_forward_tokens - jumped_before
    assert (jumped > 0) == jump_forward
