"""The native CPU decode (`braid.runtime.models.native_decode`, `braid/kernels/native/
cpu_decode.cpp`) against the Python layers it replaces: the same tokens and, up to the order
of float32 sums, the same hidden states and KV rows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from braid.kernels.cpu_decode import load_cpu_decoder
from braid.runtime.attention.torch_native import TorchNativeBackend
from braid.runtime.cache.memory_pool import KVPool, ReqToTokenPool
from braid.runtime.forward_batch import ForwardBatch, ForwardMode
from braid.runtime.layers.norm import RMSNorm
from braid.runtime.models import native_decode
from braid.runtime.models.config import ModelConfig
from braid.runtime.models.loader import build_model
from braid.runtime.models.native_decode import NativeCpuDecode
from braid.runtime.models.source import resolve_model
from braid.runtime.tokenizer.tokenizer import load_tokenizer
from tests.runtime.test_gguf import CONFIG as TINY
from tests.runtime.test_gguf import _write as write_tiny_gguf

CPU = torch.device("cpu")


def _build(path, **kw):
    cfg = ModelConfig.from_dir(path)
    model = build_model(
        cfg, path, dtype=torch.float32, device=CPU, max_positions=512, progress=False, **kw
    )
    return cfg, model


@pytest.fixture(scope="module", autouse=True)
def two_threads():
    """The native layers split attention over threads (`at::parallel_for`): two of them, even
    in a test worker given one core (tests/conftest.py), so a split that races shows here."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def embedded():
    return _build(resolve_model(None))


class Bench:
    """A model over its own pool and table: prompts prefilled by the Python path, then decode
    steps run either way on the same state."""

    def __init__(self, cfg, model, rows: list[int], *, shuffled: bool, window=None) -> None:
        self.model = model
        self.pool = KVPool(
            cfg.num_layers, 2049, 1, cfg.num_kv_heads, cfg.head_dim, torch.float32, CPU
        )
        self.table = ReqToTokenPool(4, 256, CPU)
        if shuffled:
            g = torch.Generator().manual_seed(0)
            self.table.table[:] = (torch.randperm(2048, generator=g)[: 4 * 256] + 1).view(4, 256)
        else:  # each row one ascending run
            self.table.table[:] = torch.arange(1, 4 * 256 + 1).view(4, 256)
        self.attn = TorchNativeBackend(
            self.pool, self.table, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, window
        )
        self.rows = rows

    def run(self, batch: ForwardBatch, native: bool, hidden: bool = False) -> torch.Tensor:
        inner = self.model.model
        saved = inner.native_decode
        if not native:
            inner.native_decode = None
        try:
            self.attn.init_forward_metadata(batch)
            with torch.inference_mode():
                return inner(batch, self.attn) if hidden else self.model(batch, self.attn)
        finally:
            inner.native_decode = saved

    def prefill(self, prompts: list[list[int]]) -> list[list[int]]:
        seqs = []
        for r, p in zip(self.rows, prompts):
            n = len(p)
            batch = ForwardBatch(
                mode=ForwardMode.EXTEND,
                input_ids=torch.tensor(p),
                positions=torch.arange(n),
                out_cache_loc=self.table.table[r, :n].clone(),
                req_pool_indices=torch.tensor([r]),
                seq_lens=torch.tensor([n]),
                prefix_lens=[0],
                extend_lens=[n],
                logits_indices=torch.tensor([n - 1]),
            )
            seqs.append([*p, int(self.run(batch, native=False).argmax())])
        return seqs

    def decode_batch(self, seqs: list[list[int]]) -> ForwardBatch:
        lens = [len(s) for s in seqs]
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=torch.tensor([s[-1] for s in seqs]),
            positions=torch.tensor(lens) - 1,
            out_cache_loc=torch.stack(
                [self.table.table[r, n - 1] for r, n in zip(self.rows, lens)]
            ),
            req_pool_indices=torch.tensor(self.rows),
            seq_lens=torch.tensor(lens),
            prefix_lens=[n - 1 for n in lens],
            extend_lens=[1] * len(seqs),
            logits_indices=torch.arange(len(seqs)),
        )

    def compare(self, batch: ForwardBatch, hidden: bool = False):
        """(Python path, native path) outputs and each one's stored K and V of layer 0 and
        the last layer at the batch's slots."""
        out = []
        for native in (False, True):
            # The step's own slots hold NaN until it stores them: reading one first shows.
            for buf in (*self.pool.k, *self.pool.v):
                buf[batch.out_cache_loc] = float("nan")
            y = self.run(batch, native, hidden)
            kv = [
                buf[i][batch.out_cache_loc].clone()
                for buf in (self.pool.k, self.pool.v)
                for i in (0, -1)
            ]
            out.append((y, kv))
        return out


def _close(got: torch.Tensor, want: torch.Tensor, frac: float) -> None:
    """Within `frac` of want's largest magnitude: a bfloat16 input rounded the other way
    moves an output by about 2**-8 of its size; a wrong rotation or attention moves it by
    its own size."""
    err = (got - want).abs().max().item()
    assert err <= frac * want.abs().max().item(), (err, want.abs().max().item())


def test_the_embedded_model_decodes_natively_and_its_float_form_does_not(embedded, monkeypatch):
    _, model = embedded
    assert isinstance(model.model.native_decode, NativeCpuDecode)
    _, floats = _build(resolve_model(None), dequantize_gguf=True)
    assert floats.model.native_decode is None
    monkeypatch.setattr(native_decode, "ENABLED", False)
    assert NativeCpuDecode.for_model(model.model) is None


NEAR_TIE = 0.05


@pytest.mark.parametrize("rows, shuffled", [([2], False), ([0, 2, 3], True)])
def test_native_decode_gives_the_python_layers_tokens(embedded, rows, shuffled):
    """The real model on text, 16 decode steps: the same greedy token every step (or, where
    the Python path's top two logits are within `NEAR_TIE`, one of those two: the paths round
    the int4 kernel's bfloat16 inputs at different points, about 0.02 on logits of 21, and an
    Intel Xeon's kernels tied "def fibonacci(n):"'s 13th token at 0.019), logits and stored
    K/V rows equal up to rounding; one sequence on one run of slots, and three with shuffled
    slots and different lengths."""
    cfg, model = embedded
    tok = load_tokenizer(resolve_model(None))
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land"]
    bench = Bench(cfg, model, rows, shuffled=shuffled)
    seqs = bench.prefill([tok.encode(t) for t in texts[: len(rows)]])
    for _ in range(16):
        (want, want_kv), (got, got_kv) = bench.compare(bench.decode_batch(seqs))
        for w, g in zip(want.float(), got.argmax(-1).tolist()):
            top = w.topk(2)
            tie = top.values[0] - top.values[1] < NEAR_TIE
            assert g == top.indices[0] or (tie and g == top.indices[1]), (g, top)
        _close(got, want, 0.02)
        for g, w in zip(got_kv, want_kv):
            _close(g, w, 0.02)
        for s, t in zip(seqs, got.argmax(-1).tolist()):
            s.append(t)


# Every type the CPU keeps, a fused layer of two types (layer 0's qkv: Q8_0 beside Q6_K) and
# each of the three input feeds (x, x twice for Q8_0, 8 x beside x for Q6_K).
TINY_TYPES = {
    "model.layers.0.self_attn.q_proj.weight": "Q8_0",
    "model.layers.0.self_attn.k_proj.weight": "Q8_0",
    "model.layers.0.self_attn.v_proj.weight": "Q6_K",
    "model.layers.0.self_attn.o_proj.weight": "Q4_0",
    "model.layers.0.mlp.gate_proj.weight": "Q4_K",
    "model.layers.0.mlp.up_proj.weight": "Q4_K",
    "model.layers.0.mlp.down_proj.weight": "Q4_1",
    "model.layers.1.self_attn.q_proj.weight": "Q4_1",
    "model.layers.1.self_attn.k_proj.weight": "Q4_1",
    "model.layers.1.self_attn.v_proj.weight": "Q4_1",
    "model.layers.1.self_attn.o_proj.weight": "Q6_K",
    "model.layers.1.mlp.gate_proj.weight": "Q8_0",
    "model.layers.1.mlp.up_proj.weight": "Q8_0",
    "model.layers.1.mlp.down_proj.weight": "Q4_0",
}


def _tiny_model(tmp_path_factory, config: dict, types: dict[str, str]):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, types, config=config)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("BRAID_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        blocks = resolve_model(path)
    return _build(blocks)  # outside: the native library's cache stays the default one


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _tiny_model(tmp_path_factory, TINY, TINY_TYPES)


def test_native_decode_runs_plain_multi_head_attention_and_odd_head_dims(tmp_path_factory):
    """One query head per KV head, and a head dim of 40 (not a multiple of the 16 lanes)."""
    config = {**TINY, "hidden_size": 160, "intermediate_size": 256, "num_key_value_heads": 4}
    names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
    names += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    types = {f"model.layers.{i}.{n}.weight": "Q4_0" for i in range(2) for n in names}
    cfg, model = _tiny_model(tmp_path_factory, config, types)
    assert (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads) == (40, 4, 4)
    assert isinstance(model.model.native_decode, NativeCpuDecode)
    _tiny_steps(cfg, model)


def _tiny_steps(cfg, model, steps=6, window=None):
    bench = Bench(cfg, model, [1, 3], shuffled=True, window=window)
    g = torch.Generator().manual_seed(1)
    seqs = bench.prefill([torch.randint(0, 320, (n,), generator=g).tolist() for n in (5, 11)])
    for _ in range(steps):
        batch = bench.decode_batch(seqs)
        (want, want_kv), (got, got_kv) = bench.compare(batch, hidden=True)
        _close(got, want, 0.02)
        for gk, wk in zip(got_kv, want_kv):
            _close(gk, wk, 0.02)
        for s in seqs:
            s.append(int(torch.randint(0, 320, (1,), generator=g)))


@pytest.mark.parametrize("window", [None, 32])
def test_native_decode_runs_every_kept_type_and_fused_segments(tiny, window):
    """With a sliding window of 32 that hides no key yet, too."""
    cfg, model = tiny
    assert isinstance(model.model.native_decode, NativeCpuDecode)
    _tiny_steps(cfg, model, window=window)


def test_rows_of_one_request_in_one_step_see_each_others_keys(tiny):
    """A speculative verify (or draft catch-up) step: rows n and n + 1 of one request in one
    batch; the second attends to the K/V the first stores in the same call (NaN before it)."""
    cfg, model = tiny
    bench = Bench(cfg, model, [2], shuffled=True)
    (seq,) = bench.prefill([[9, 8, 7, 6, 5, 4, 3]])
    n, r = len(seq), 2
    batch = ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.tensor([seq[-1], 11]),
        positions=torch.tensor([n - 1, n]),
        out_cache_loc=bench.table.table[r, n - 1 : n + 1].clone(),
        req_pool_indices=torch.tensor([r, r]),
        seq_lens=torch.tensor([n, n + 1]),
        prefix_lens=[n - 1, n],
        extend_lens=[1, 1],
        logits_indices=torch.arange(2),
    )
    (want, want_kv), (got, got_kv) = bench.compare(batch, hidden=True)
    _close(got, want, 0.02)
    for g, w in zip(got_kv, want_kv):
        _close(g, w, 0.02)
    assert torch.isfinite(got).all()
    # The second row as a step of its own, after the first's: the same output.
    alone = bench.run(bench.decode_batch([seq + [11]]), native=True, hidden=True)
    _close(alone, want[1:], 0.02)


def test_native_decode_adds_biases_and_norms_q_and_k_per_head(tiny):
    """Qwen2's projection biases and Qwen3's per-head q/k norms, given to the tiny model's
    layers: the Python layers use them, and a decoder rebuilt from the layers does too."""
    cfg, model = tiny
    g = torch.Generator().manual_seed(2)
    saved = model.model.native_decode
    try:
        for layer in model.model.layers:
            sa = layer.self_attn
            for proj in (sa.qkv_proj, sa.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                proj.bias = nn.Parameter(torch.randn(proj.out_features, generator=g) * 0.1)
            sa.qk_norm = True
            sa.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, torch.float32)
            sa.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, torch.float32)
            sa.q_norm.weight.data = 1 + 0.3 * torch.randn(cfg.head_dim, generator=g)
            sa.k_norm.weight.data = 1 + 0.3 * torch.randn(cfg.head_dim, generator=g)
        model.model.native_decode = NativeCpuDecode.for_model(model.model)
        assert model.model.native_decode is not None
        _tiny_steps(cfg, model)
    finally:
        for layer in model.model.layers:
            sa = layer.self_attn
            for proj in (sa.qkv_proj, sa.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                proj.bias = None
            sa.qk_norm = False
        model.model.native_decode = saved


def test_steps_it_would_compute_otherwise_take_the_python_path(tiny):
    """A sliding window that hides keys, draft-tree tails, an fp8 pool, an extend: None."""
    cfg, model = tiny
    native = model.model.native_decode
    bench = Bench(cfg, model, [1], shuffled=False, window=8)
    seqs = bench.prefill([[3, 4, 5, 6, 7]])
    batch = bench.decode_batch(seqs)
    h = model.model.embed_tokens(batch.input_ids)
    cos_sin = model.model.rotary.lookup(batch.positions)
    assert native(h, cos_sin, batch, bench.attn) is not None  # 6 keys, a window of 8
    seqs[0] += [1, 2, 3]
    longer = bench.decode_batch(seqs)
    assert native(model.model.embed_tokens(longer.input_ids), cos_sin, longer, bench.attn) is None
    batch.tree_prefix = torch.tensor([3])
    assert native(h, cos_sin, batch, bench.attn) is None
    batch.tree_prefix = None
    fp8 = KVPool(cfg.num_layers, 64, 1, cfg.num_kv_heads, cfg.head_dim, torch.float8_e4m3fn, CPU)
    fp8_attn = TorchNativeBackend(fp8, bench.table, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    assert native(h, cos_sin, batch, fp8_attn) is None
    batch.mode = ForwardMode.EXTEND
    assert native(h, cos_sin, batch, bench.attn) is None


def test_a_process_loads_the_library_once_wherever_asked(embedded, tmp_path):
    """Loaded already (the embedded model's): another cache directory gets the same class and
    builds nothing there (a second copy of the library would abort the process)."""
    cls, line = load_cpu_decoder(tmp_path)
    assert cls is not None and "loaded" in line
    assert not any(tmp_path.rglob("*.so"))


def test_a_failed_build_leaves_the_python_path_with_the_reason(tmp_path, monkeypatch):
    from braid.kernels import cpu_decode

    monkeypatch.setattr(cpu_decode, "_loaded", {})  # as in a process that loaded none yet
    monkeypatch.setenv("CXX", "false")
    cls, line = load_cpu_decoder(tmp_path)
    assert cls is None
    assert "Python path runs" in line and "false failed" in line
    assert not any(tmp_path.rglob("*.so"))


def test_the_library_is_built_once_per_source_and_kept(tmp_path, monkeypatch):
    """A second build finds the first's library; a changed source gets its own key."""
    from braid.kernels import cpu_decode
    from braid.runtime.models.source import cache_root

    path, _ = cpu_decode.build(cache_root() / "native")  # the runtime's cache: built already
    assert path.exists() and cpu_decode.build(path.parent.parent) == (path, 0.0)
    edited = tmp_path / "cpu_decode.cpp"
    edited.write_text(cpu_decode.SOURCE.read_text() + "\n// edited\n")
    key = cpu_decode.library_key()
    monkeypatch.setattr(cpu_decode, "SOURCE", edited)
    assert cpu_decode.library_key() != key
