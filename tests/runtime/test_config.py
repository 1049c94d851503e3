"""Settings are declared once: `EngineConfig`'s fields give `LLM`'s keywords and `braid serve`'s
flags (with `ServerSettings` for the server's own), with one doc and one default each."""

from __future__ import annotations

import argparse
import subprocess
import sys
import typing
from dataclasses import fields, replace

import pytest

import braid
from braid.runtime import engine
from braid.runtime.config import EngineConfig
from braid.runtime.config_fields import choices_of, python_name
from braid.runtime.config_keywords import keyword_names, resolve_overrides
from braid.runtime.server.cli import (
    SERVE_DEFAULTS,
    ServerSettings,
    build_parser,
    main,
    serve,
    settings_from_args,
)

ENGINE_FIELDS = fields(EngineConfig)
SERVER_FIELDS = fields(ServerSettings)
# Every flag `braid serve` accepted before its flags were generated from the fields: scripts,
# tests/server and docs/server.md use them, so each must keep parsing.
FLAGS_BEFORE = """
--model --model-path --host --port --api-key --api-key-file --dtype --device --context-length
--max-running-requests --max-total-tokens --mem-fraction-static --max-prefill-tokens
--chunked-prefill-size --page-size --schedule-policy --disable-radix-cache --chat-template
--tool-call-parser --served-model-name --strict-model-name --load-format --attention-backend
--cuda-graph-max-bs --disable-cuda-graph --disable-overlap-schedule --seed
--grammar-compile-timeout --disable-jump-forward --max-request-bytes --max-samples-per-request
--allow-request-chat-template --allowed-origins --allowed-hosts --header-timeout --body-timeout
--keep-alive-timeout --health-timeout --heartbeat-timeout --max-session-pins --session-ttl
--log-level
""".split()


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def serve_actions() -> dict[str, argparse.Action]:
    """The serve subcommand's actions by option string."""
    ap = build_parser()
    (sub,) = [a for a in ap._actions if isinstance(a, argparse._SubParsersAction)]
    return {opt: a for a in sub.choices["serve"]._actions for opt in a.option_strings}


def sample_value(cls: type, f) -> str:
    """A valid command-line value for field `f` that differs from its default."""
    if f.name == "dist_init_addr":
        return "127.0.0.1:1234"
    choices = choices_of(f)
    if choices is not None:
        return str(next(c for c in choices if c != f.default))
    hint = typing.get_type_hints(cls)[f.name]
    kind = typing.get_args(hint) or (hint,)
    if int in kind:
        return "7"
    if float in kind:
        return "0.5"
    return "some-value"


# ---- LLM keywords --------------------------------------------------------------------------


def test_every_field_is_an_llm_keyword_by_its_own_name():
    for f in ENGINE_FIELDS:
        marker = object()
        assert resolve_overrides({f.name: marker}) == {f.name: marker}


def test_an_sglang_alias_is_an_llm_keyword_for_its_field():
    assert resolve_overrides({"max_total_tokens": 4096}) == {"kv_tokens": 4096}
    assert resolve_overrides({"model_path": "d"}) == {"model": "d"}
    # vLLM's names where the meaning is the same.
    assert resolve_overrides({"max_model_len": 256}) == {"context_length": 256}
    assert resolve_overrides({"enforce_eager": True}) == {"disable_cuda_graph": True}
    assert resolve_overrides({"max_num_seqs": 8}) == {"max_running_requests": 8}
    assert resolve_overrides({"random_seed": 3}) == {"seed": 3}  # SGLang's
    names = keyword_names()
    for f in ENGINE_FIELDS:
        for alias in f.metadata["aliases"]:
            assert names[python_name(alias)] == f.name


def test_an_unknown_keyword_is_a_value_error_naming_it_and_the_close_matches():
    with pytest.raises(
        ValueError, match=r"unknown engine setting 'kv_token': did you mean 'kv_tokens'"
    ):
        resolve_overrides({"kv_token": 64})
    with pytest.raises(ValueError, match="'schedule_policy'"):
        resolve_overrides({"schedule_polcy": "lpm"})
    # Nothing close: the message lists the settings instead.
    with pytest.raises(
        ValueError, match="zzz.*the settings are model, revision, gguf_file, dtype, device"
    ):
        resolve_overrides({"zzz": 1})


def test_another_engines_setting_of_another_meaning_says_what_to_use(capsys):
    """Close spellings pointed at settings of another meaning (max_num_batched_tokens ->
    max_total_tokens, the KV pool's size; enable_prefix_caching -> enable_mixed_chunk)."""
    with pytest.raises(ValueError, match="'max_num_batched_tokens': vLLM's token budget.*chunk"):
        resolve_overrides({"max_num_batched_tokens": 64})
    with pytest.raises(SystemExit):  # a keyword of LLM's (test below), not a flag
        main(["serve", "--enable-prefix-caching"])
    assert "prefix cache is always on; --disable-radix-cache" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["serve", "--data-parallel-size", "2"])
    assert e.value.code == 2
    assert "--data-parallel-size 2 (one LLM is one engine; data parall" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "--max-num-seqs", "3", "--random-seed", "5"])
    config = settings_from_args(EngineConfig, args)
    assert (config.max_running_requests, config.seed) == (3, 5)


def test_vllms_keywords_whose_values_braid_has_otherwise_are_taken(tmp_path, monkeypatch):
    """vLLM's on/off keywords as braid's settings (None, vLLM's default, is on; an explicit
    on beside braid's off contradicts it); permission to run a checkpoint's code and swap
    space change nothing (braid runs no such code and keeps no swap); a tokenizer only if it
    names the model, however spelled; the GPU memory share as mem_fraction_static on CUDA,
    left aside on the CPU. Every refusal is a ValueError naming the keyword."""
    assert resolve_overrides({"enable_prefix_caching": False}) == {"disable_radix_cache": True}
    assert resolve_overrides({"enable_chunked_prefill": False}) == {"chunked_prefill_size": -1}
    on = {"enable_prefix_caching": True, "enable_chunked_prefill": None}
    assert resolve_overrides({**on, "trust_remote_code": True, "swap_space": 4}) == {}
    assert resolve_overrides({"block_size": 16}) == {"page_size": 16}  # vLLM's KV block
    with pytest.raises(ValueError, match="enable_prefix_caching=True contradicts disable_radix"):
        resolve_overrides({"enable_prefix_caching": True, "disable_radix_cache": True})
    with pytest.raises(ValueError, match="enable_chunked_prefill=True contradicts chunked_pre"):
        resolve_overrides({"enable_chunked_prefill": True, "chunked_prefill_size": -1})
    with pytest.raises(ValueError, match="chunked_prefill_size is given twice"):
        resolve_overrides({"enable_chunked_prefill": False, "chunked_prefill_size": 64})
    with pytest.raises(ValueError, match="swap_space must be a number of GiB >= 0, got -1"):
        resolve_overrides({"swap_space": -1})
    with pytest.raises(ValueError, match="trust_remote_code must be true, false or None"):
        resolve_overrides({"trust_remote_code": "yes"})
    # The tokenizer: the model's, named as vLLM's model_path or by another spelling of it.
    (tmp_path / "m").mkdir()
    monkeypatch.chdir(tmp_path)
    for model, tokenizer in [("m", "./m/"), (tmp_path / "m", "m"), (None, "smollm2-135m")]:
        given = {"model_path": model, "tokenizer": tokenizer}
        assert "tokenizer" not in resolve_overrides(given)
    with pytest.raises(ValueError, match="tokenizer 'other': the tokenizer is the model"):
        resolve_overrides({"model": "m", "tokenizer": "other"})
    # The same share on CUDA; on the CPU it means nothing (0.9 of free RAM for the KV cache
    # alone would be braid's mem_fraction_static there), as in vLLM's CPU backend.
    assert resolve_overrides({"gpu_memory_utilization": 0.8, "device": "cuda:1"}) == {
        "device": "cuda:1",
        "mem_fraction_static": 0.8,
    }
    assert resolve_overrides({"gpu_memory_utilization": 1.0, "device": "cpu"}) == {"device": "cpu"}
    with pytest.raises(ValueError, match="gpu_memory_utilization 1 leaves nothing"):
        resolve_overrides({"gpu_memory_utilization": 1, "device": "cuda"})
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\], got 90"):
        resolve_overrides({"gpu_memory_utilization": 90})
    for device in ("cpu", "cuda"):  # the same refusal on either
        both = {"gpu_memory_utilization": 0.5, "mem_fraction_static": 0.5, "device": device}
        with pytest.raises(ValueError, match="are the same share on CUDA: give one"):
            resolve_overrides(both)


def test_a_field_given_under_two_names_is_refused():
    with pytest.raises(ValueError, match="kv_tokens is given twice"):
        resolve_overrides({"kv_tokens": 64, "max_total_tokens": 128})


@pytest.fixture()
def no_start(monkeypatch):
    """`LLM.__init__` stops where it would load the model, so no process starts; the
    half-built LLM keeps the config it resolved."""

    class Stop(Exception):
        pass

    def load(model, **_):
        raise Stop(model)

    monkeypatch.setattr(engine.ModelAssets, "load", load)
    return Stop


def test_llm_builds_its_config_from_its_keywords(no_start, tmp_path):
    llm = braid.LLM.__new__(braid.LLM)
    with pytest.raises(no_start) as stop:
        llm.__init__(tmp_path, max_total_tokens=256, max_session_pins=3, show_progress=False)
    assert str(stop.value) == str(tmp_path)
    assert llm.config == EngineConfig(
        model=str(tmp_path), kv_tokens=256, max_session_pins=3, show_progress=False
    )
    llm = braid.Engine.__new__(braid.Engine)
    with pytest.raises(no_start):
        llm.__init__(model_path="m")
    assert llm.config == EngineConfig(model="m")


def test_llm_refuses_an_unknown_or_invalid_setting_before_anything_starts(no_start):
    with pytest.raises(ValueError, match="did you mean 'page_size'"):
        braid.LLM(page_sizes=2)
    with pytest.raises(ValueError, match="schedule_policy must be one of"):
        braid.LLM(schedule_policy="random")


# ---- declarations ----------------------------------------------------------------------------


@pytest.mark.parametrize("f", [*ENGINE_FIELDS, *SERVER_FIELDS], ids=lambda f: f.name)
def test_every_setting_declares_a_doc(f):
    assert f.metadata["doc"].strip()


def test_a_value_outside_a_fields_choices_names_the_field_and_the_choices():
    with pytest.raises(
        ValueError,
        match=r"schedule_policy must be one of "
        r"\['fcfs', 'lpm', 'priority', 'program', 'program-srpt'\]",
    ):
        EngineConfig(schedule_policy="random")
    with pytest.raises(ValueError, match="attention_backend must be None or one of"):
        EngineConfig(attention_backend="nope")
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(dtype="int3")
    with pytest.raises(ValueError, match="log_level must be None or one of"):
        ServerSettings(log_level="loud")
    with pytest.raises(ValueError, match="max_samples_per_request"):
        ServerSettings(max_samples_per_request=0)


def test_unset_prefill_budget_is_sized_by_device():
    assert EngineConfig(device="cpu").effective_max_prefill_tokens == 8192
    assert EngineConfig(device="cuda").effective_max_prefill_tokens == 16384
    assert EngineConfig(device="cuda", max_prefill_tokens=100).effective_max_prefill_tokens == 100


# ---- braid serve flags ---------------------------------------------------------------------


def test_every_field_has_a_flag_by_its_name_with_its_doc_as_help():
    actions = serve_actions()
    for f in [*ENGINE_FIELDS, *SERVER_FIELDS]:
        action = actions[flag(f.name)]
        assert action.dest == f.name
        assert f.metadata["doc"].split(";")[0].replace("%", "%%") in action.help
        for alias in f.metadata["aliases"]:
            assert actions[alias] is action


def test_every_flag_accepted_before_still_parses():
    missing = [f for f in FLAGS_BEFORE if f not in serve_actions()]
    assert not missing


def test_fixed_choices_are_the_flags_choices():
    actions = serve_actions()
    for f in [*ENGINE_FIELDS, *SERVER_FIELDS]:
        if isinstance(f.metadata["choices"], tuple):
            assert list(actions[flag(f.name)].choices) == choices_of(f)
    with pytest.raises(SystemExit):
        parse("--generation-config", "random")


def test_an_empty_command_line_gives_the_declared_defaults():
    args = parse()
    assert settings_from_args(EngineConfig, args) == replace(EngineConfig(), **SERVE_DEFAULTS)
    assert settings_from_args(ServerSettings, args) == ServerSettings()
    assert SERVE_DEFAULTS == {"show_progress": False}


# Flags that are valid only beside another one, and that other one.
COMPANIONS = {
    "speculative_draft_model_path": ["--speculative-algorithm", "DRAFT"],
    "speculative_ngram_min_match_window_size": [
        "--speculative-ngram-max-match-window-size",
        "8",
        "--speculative-algorithm",
        "NGRAM",
    ],
    "speculative_ngram_max_match_window_size": ["--speculative-algorithm", "NGRAM"],
    "speculative_num_steps": ["--speculative-algorithm", "NGRAM"],
    "speculative_eagle_topk": ["--speculative-algorithm", "NGRAM"],
    "speculative_num_draft_tokens": ["--speculative-algorithm", "NGRAM"],
    "nnodes": ["--tp-size", "14", "--dist-init-addr", "127.0.0.1:1234"],
    "node_rank": ["--nnodes", "8", "--tp-size", "8", "--dist-init-addr", "127.0.0.1:1234"],
}
# Registry names that need an optional package (refused without it): the test takes another.
NEEDS_PACKAGE = {"flashinfer"}


@pytest.mark.parametrize("cls", [EngineConfig, ServerSettings])
def test_each_flag_sets_its_field_with_the_fields_type(cls):
    for f in fields(cls):
        if f.metadata["choices"] is not None and callable(f.metadata["choices"]):
            argv = [flag(f.name), [c for c in choices_of(f) if c not in NEEDS_PACKAGE][0]]
        elif typing.get_type_hints(cls)[f.name] in (bool, bool | None):
            on = SERVE_DEFAULTS.get(f.name, f.default) is True  # its --no- flag turns it off
            argv = ["--no-" + flag(f.name)[2:] if on else flag(f.name)]
        else:
            argv = [flag(f.name), sample_value(cls, f)]
        argv += COMPANIONS.get(f.name, [])
        got = getattr(parse(*argv), f.name)
        assert got != f.default or f.name in SERVE_DEFAULTS, f.name
        assert getattr(settings_from_args(cls, parse(*argv)), f.name) == got


def test_each_sglang_flag_parses_to_the_same_config_as_the_primary_flag():
    aliased = [f for f in ENGINE_FIELDS if f.metadata["aliases"]]
    assert {f.name for f in aliased} >= {"model", "kv_tokens", "grammar_compile_timeout_s"}
    for f in aliased:
        # A switch takes no value (its alias sets it as its own flag does).
        value = () if f.type in (bool, "bool") else (sample_value(EngineConfig, f),)
        primary = settings_from_args(EngineConfig, parse(flag(f.name), *value))
        for alias in f.metadata["aliases"]:
            assert settings_from_args(EngineConfig, parse(alias, *value)) == primary
    assert parse("--max-total-tokens", "64").kv_tokens == 64


def test_overlap_schedule_is_unset_on_or_off():
    assert parse().overlap_schedule is None
    assert parse("--overlap-schedule").overlap_schedule is True
    assert parse("--no-overlap-schedule").overlap_schedule is False
    assert parse("--disable-overlap-schedule").overlap_schedule is False


def test_serve_refuses_a_bad_setting_with_status_2_before_anything_starts():
    assert serve(parse("--max-samples-per-request", "0", "--log-level", "error")) == 2
    assert serve(parse("--attention-backend", "nope", "--log-level", "error")) == 2


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as done:
        main(["serve", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for f in [*ENGINE_FIELDS, *SERVER_FIELDS]:
        assert flag(f.name) in text
    assert "--max-total-tokens" in text and "(default: 256)" in text


def test_python_dash_m_braid_serve_help_runs():
    out = subprocess.run(
        [sys.executable, "-m", "braid", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "--kv-tokens" in out.stdout and "--disable-overlap-schedule" in out.stdout


def test_vllms_speculative_config_stands_for_the_speculative_flags():
    got = settings_from_args(
        EngineConfig,
        parse("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'),
    )
    assert got.speculative_algorithm == "NGRAM" and got.speculative_num_steps == 3
    with pytest.raises(ValueError, match="speculative_num_steps is given twice"):
        settings_from_args(
            EngineConfig,
            parse(
                "--speculative-num-steps",
                "2",
                "--speculative-config",
                '{"method": "ngram", "num_speculative_tokens": 3}',
            ),
        )
    with pytest.raises(ValueError, match="speculative_config: unknown key 'draft'"):
        settings_from_args(EngineConfig, parse("--speculative-config", '{"draft": 1}'))
    assert resolve_overrides({"speculative_config": {"model": "d"}}) == {
        "speculative_draft_model_path": "d",
        "speculative_algorithm": "DRAFT",
    }
    # What would turn nothing on is refused, as vLLM refuses it (it was taken, speculation off).
    for spec in ({"num_speculative_tokens": 4}, {"method": None, "prompt_lookup_max": 4}):
        with pytest.raises(ValueError, match="speculative_config needs a method or a model"):
            resolve_overrides({"speculative_config": spec})
    for kw, first in (
        (dict(speculative_num_steps=4), "speculative_num_steps"),
        (dict(speculative_ngram_max_match_window_size=6), "speculative_ngram_max_match_window"),
    ):
        with pytest.raises(ValueError, match=f"{first}.* is set but speculative_algorithm is not"):
            EngineConfig(**kw)
    with pytest.raises(ValueError, match="speculative_draft_model_path does not go with .*NGRAM"):
        EngineConfig(speculative_algorithm="NGRAM", speculative_draft_model_path="d")


def test_a_model_directorys_bad_json_is_named(tmp_path):
    from braid.runtime.assets import ModelAssets
    from braid.runtime.models.config import ModelConfig

    (tmp_path / "config.json").write_text("{'model_type': 'llama'}")
    for load in (ModelConfig.from_dir, ModelAssets.load):
        with pytest.raises(ValueError, match=r"config\.json: not valid JSON \(Expecting property"):
            load(tmp_path)
    (tmp_path / "config.json").write_text("[]")
    with pytest.raises(ValueError, match=r"config\.json: not a JSON object"):
        ModelConfig.from_dir(tmp_path)
