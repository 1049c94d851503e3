"""benchmarks/kernel_timings.py runs (tiny shapes; on CPU through the interpreter), so the GPU
benchmark does not rot unseen; without CUDA its real run refuses with a clear message.
In-process (`main(argv)`): a subprocess would pay the torch and Triton imports again."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.kernel_timings import KERNELS, main


def test_smoke_run_times_every_kernel_and_writes_json(tmp_path, capsys):
    out = tmp_path / "k.json"
    main(["--smoke", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["benchmark"] == "kernels" and result["machine"]["torch"]
    assert sorted({r["kernel"] for r in result["rows"]}) == sorted(KERNELS)
    assert all(r["triton_us"] > 0 and r["torch_us"] > 0 for r in result["rows"])
    assert "decode_attention" in capsys.readouterr().out  # the printed table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_without_cuda_it_exits_with_a_message():
    with pytest.raises(SystemExit) as exc:
        main([])
    assert "CUDA GPU" in str(exc.value.code) and "--smoke" in str(exc.value.code)
