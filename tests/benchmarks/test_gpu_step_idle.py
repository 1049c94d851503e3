"""benchmarks/gpu_step.py's idle accounting of a profiled step (`_idle`), on a step's event
list as torch.profiler gives it: overlapping kernels count once, gaps inside and outside."""

from types import SimpleNamespace

from benchmarks.gpu_step import _idle


def _event(kind: str, start: float, end: float, name: str) -> SimpleNamespace:
    return SimpleNamespace(
        device_type=SimpleNamespace(name=kind),
        time_range=SimpleNamespace(start=start, end=end),
        name=name,
    )


def test_idle_counts_overlaps_once_and_ranks_the_gaps():
    prof = SimpleNamespace(
        events=lambda: [
            _event("CUDA", 100.0, 300.0, "gemm"),
            _event("CUDA", 250.0, 400.0, "norm"),  # overlaps gemm: 100-400 busy
            _event("CPU", 400.0, 900.0, "aten::copy_"),  # host work is not a kernel
            _event("CUDA", 1400.0, 1500.0, "attention"),  # 1000 us gap after norm
            _event("CUDA", 1550.0, 1600.0, "sample"),  # 50 us gap
            _event("CUDA", 1600.0, 1600.0, "empty"),  # no duration: ignored
        ]
    )
    idle = _idle(prof, wall_ms=2.0)
    assert idle["busy_ms"] == 0.45  # 300 + 100 + 50 us
    assert idle["gaps_inside_ms"] == 1.05  # span 1500 us less busy
    assert abs(idle["outside_kernels_ms"] - 0.5) < 1e-12  # wall 2 ms less the 1.5 ms span
    assert [g["us"] for g in idle["widest_gaps"]] == [1000.0, 50.0]
    assert idle["widest_gaps"][0] == {"us": 1000.0, "after": "norm", "before": "attention"}
    assert _idle(SimpleNamespace(events=lambda: []), 1.0) == {}
