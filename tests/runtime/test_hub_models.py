"""Hub model ids (`org/name[@revision][:QUANT]`) resolved through a Hugging Face cache built on
disk in the documented layout (tests/hub_cache.py), with the network off: HF_HUB_OFFLINE, or a
hub endpoint that refuses connections."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from braid.runtime.ipc.sockets import free_port
from braid.runtime.models.hub import ModelId, choose_files
from braid.runtime.models.source import resolve_model
from braid.runtime.quantization.gguf_file import write_llama_gguf
from tests.conftest import hf_greedy
from tests.hub_cache import add_snapshot, build_tiny_chat_model, dir_files

REPO = "braid-test/tiny-chat"
GGUF_REPO = "braid-test/tiny-gguf"
GGUF_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    vocab_size=64,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def _tiny_gguf(path: Path, qtype: str) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    state = LlamaForCausalLM(LlamaConfig(**GGUF_CONFIG)).state_dict()
    types = {k: qtype for k, v in state.items() if v.dim() == 2}
    write_llama_gguf(path, GGUF_CONFIG, state, types, {})
    return path


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """HF_HOME with: REPO at main (commit `main`) and at tag v1 (other weights, commit `v1`),
    files a model does not need beside them; GGUF_REPO with a Q4_1 and a Q8_0 file."""
    root = tmp_path_factory.mktemp("hf_home")
    models = tmp_path_factory.mktemp("models")
    main_dir = build_tiny_chat_model(models / "main", seed=1234)
    v1_dir = build_tiny_chat_model(models / "v1", seed=99)
    extras = {"pytorch_model.bin": b"not loaded", "onnx/model.safetensors": b"not loaded"}
    cache = root / "hub"
    commits = {
        "main": add_snapshot(cache, REPO, {**dir_files(main_dir), **extras}),
        "v1": add_snapshot(cache, REPO, dir_files(v1_dir), refs=("v1",)),
    }
    ggufs = {q: _tiny_gguf(models / f"tiny-llama.{q}.gguf", q) for q in ("Q4_1", "Q8_0")}
    add_snapshot(cache, GGUF_REPO, {p.name: p for p in ggufs.values()})
    return {"home": root, "cache": cache, "commits": commits, "main": main_dir, "v1": v1_dir}


@pytest.fixture
def offline(hub, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(hub["home"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return hub


def _snapshot(hub, name: str) -> Path:
    return hub["cache"] / "models--braid-test--tiny-chat" / "snapshots" / hub["commits"][name]


def test_hub_id_generates_the_tokens_of_its_directory(offline):
    from transformers import AutoModelForCausalLM

    import braid

    prompts = [[5, 17, 99, 3, 250], [7, 8, 200, 31]]
    params = braid.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = {}
    for model in (REPO, offline["main"]):
        with braid.LLM(model, kv_tokens=512, show_progress=False) as llm:
            if model == REPO:
                assert llm.model_path == _snapshot(offline, "main")
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            tokens[model] = [o.outputs[0].token_ids for o in outs]
    assert tokens[REPO] == tokens[offline["main"]]
    ref = AutoModelForCausalLM.from_pretrained(str(offline["main"]), dtype=torch.float32).eval()
    assert tokens[REPO] == [hf_greedy(ref, p, 8, eos=False) for p in prompts]


def test_revision_picks_its_snapshot(offline):
    main, v1 = _snapshot(offline, "main"), _snapshot(offline, "v1")
    assert resolve_model(REPO) == main
    assert resolve_model(f"{REPO}@main") == main
    assert resolve_model(f"{REPO}@v1") == v1
    assert resolve_model(REPO, revision="v1") == v1
    assert resolve_model(f"{REPO}@{offline['commits']['v1']}") == v1
    # The two snapshots really differ: the revision decides which weights load.
    assert (main / "model.safetensors").read_bytes() != (v1 / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="names revision 'v1' but revision is 'main'"):
        resolve_model(f"{REPO}@v1", revision="main")


def test_a_model_not_in_the_cache_offline_says_so_and_how_to_get_it(offline):
    with pytest.raises(ValueError) as e:
        resolve_model("braid-test/absent")
    msg = str(e.value)
    assert "not in the Hugging Face cache" in msg and str(offline["cache"]) in msg
    assert "HF_HUB_OFFLINE is set" in msg and "`hf download braid-test/absent`" in msg


def test_a_revision_not_in_the_cache_lists_the_cached_ones(offline):
    with pytest.raises(ValueError) as e:
        resolve_model(f"{REPO}@v2")
    msg = str(e.value)
    assert "revision 'v2'" in msg and "not in the Hugging Face cache" in msg
    assert f"main ({offline['commits']['main'][:12]})" in msg
    assert f"v1 ({offline['commits']['v1'][:12]})" in msg
    assert f"hf download {REPO} --revision v2" in msg


def test_an_unreachable_hub_fails_fast_and_a_cached_model_still_loads(hub, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(hub["home"]))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    # A real connection attempt to a port nothing listens on: refused at once.
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as e:
        resolve_model("braid-test/absent")
    assert time.perf_counter() - t0 < 5.0
    msg = str(e.value)
    assert "not in the Hugging Face cache" in msg and "could not be reached" in msg
    assert resolve_model(REPO) == _snapshot(hub, "main")


@pytest.mark.parametrize("tag", ["Q8_0", "q4_1"])
def test_a_quantization_tag_loads_that_gguf_file(offline, tag, tmp_path, monkeypatch):
    monkeypatch.setenv("BRAID_CACHE_DIR", str(tmp_path))
    path = resolve_model(f"{GGUF_REPO}:{tag}")
    types = json.loads((path / "config.json").read_text())["quantization_config"]["tensor_types"]
    assert set(types.values()) - {"F32"} == {tag.upper()}  # the norms are float32
    by_name = resolve_model(GGUF_REPO, gguf_file=f"tiny-llama.{tag.upper()}.gguf")
    assert by_name == path


def test_a_gguf_repository_without_a_pick_lists_its_files(offline):
    with pytest.raises(ValueError, match=r"has 2 GGUF files: pick one .*Q4_1.*Q8_0"):
        resolve_model(GGUF_REPO)
    with pytest.raises(ValueError, match="no GGUF file matches 'Q5_K_M'"):
        resolve_model(f"{GGUF_REPO}:Q5_K_M")
    with pytest.raises(ValueError, match="names a quantization and gguf_file is set"):
        resolve_model(f"{GGUF_REPO}:Q8_0", gguf_file="tiny-llama.Q8_0.gguf")


def test_choose_files_takes_what_a_model_needs():
    repo = [
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "pytorch_model.bin",
        "onnx/model.safetensors",
        "README.md",
        ".gitattributes",
    ]
    assert choose_files("o/n", repo) == sorted(
        set(repo) - {"pytorch_model.bin", "onnx/model.safetensors", "README.md", ".gitattributes"}
    )
    with pytest.raises(ValueError, match="no safetensors or GGUF weights"):
        choose_files("o/n", ["config.json", "pytorch_model.bin"])
    with pytest.raises(ValueError, match="no config.json"):
        choose_files("o/n", ["model.safetensors"])


def test_choose_files_matches_a_quantization_tag_exactly():
    ggufs = [
        "Model-Q4_K_M.gguf",
        "Model-Q4_K_S.gguf",
        "Model-Q4_0.gguf",
        "Model-Q8_0.gguf",
        "mmproj-Model-Q8_0.gguf",
        "split/Model-Q6_K-00001-of-00002.gguf",
    ]
    assert choose_files("o/n", ggufs, quant="Q4_K_M") == ["Model-Q4_K_M.gguf"]
    assert choose_files("o/n", ggufs, quant="q4_0") == ["Model-Q4_0.gguf"]
    # The vision projector is never taken for the model.
    assert choose_files("o/n", ggufs, quant="Q8_0") == ["Model-Q8_0.gguf"]
    with pytest.raises(ValueError, match="no GGUF file matches 'Q4_K'"):
        choose_files("o/n", ggufs, quant="Q4_K")  # Q4_K_M and Q4_K_S are other files
    with pytest.raises(ValueError, match="split GGUF"):
        choose_files("o/n", ggufs, quant="Q6_K")
    assert choose_files("o/n", ggufs, gguf_file="Model-Q4_K_S.gguf") == ["Model-Q4_K_S.gguf"]
    with pytest.raises(ValueError, match="has no file 'Model-F16.gguf'"):
        choose_files("o/n", ggufs, gguf_file="Model-F16.gguf")
    assert choose_files("o/n", ["only.Q4_0.gguf", "README.md"]) == ["only.Q4_0.gguf"]


def test_model_ids_parse_and_paths_do_not():
    assert ModelId.parse("Qwen/Qwen2.5-0.5B-Instruct") == ModelId("Qwen/Qwen2.5-0.5B-Instruct")
    assert ModelId.parse("org/name@v1.0:Q4_K_M") == ModelId("org/name", "v1.0", "Q4_K_M")
    assert ModelId.parse("org/name@refs/pr/3") == ModelId("org/name", "refs/pr/3")
    assert ModelId.parse("org/name:Q8_0") == ModelId("org/name", None, "Q8_0")
    for not_an_id in ["./org/name", "/models/llama", "~/m/x", "name", "a/b/c", "org/na me"]:
        assert ModelId.parse(not_an_id) is None, not_an_id


def test_a_local_directory_wins_over_a_hub_id_and_takes_no_revision(offline, monkeypatch):
    monkeypatch.chdir(offline["main"].parent)  # holds main/ and v1/: "main" is no hub id
    local = offline["main"].parent / "org" / "model"
    local.parent.mkdir(exist_ok=True)
    if not local.exists():
        local.symlink_to(offline["main"])
    assert resolve_model("org/model") == Path("org/model")
    with pytest.raises(ValueError, match="applies to a hub model id"):
        resolve_model("org/model", revision="v1")


def test_llm_with_a_missing_hub_model_raises_before_starting(offline):
    import braid

    with pytest.raises(ValueError, match="not in the Hugging Face cache"):
        braid.LLM("braid-test/absent")
