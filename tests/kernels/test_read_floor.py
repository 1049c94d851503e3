"""The read floor of `benchmarks/quant_kernels.py` (a kernel that only reads a layer's bytes,
the bound any one-row GEMV over them meets), under the interpreter."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def test_the_read_floor_kernel_reads_every_word_once():
    """`_read_kernel` (the read floor): each program's xor is that of its own slice, at program
    counts that leave a ragged last slice and an idle tail."""
    import numpy as np

    from benchmarks.quant_kernels import read_words, xor_all

    gen = torch.Generator().manual_seed(0)
    src = torch.randint(-(2**31), 2**31 - 1, (1000,), generator=gen, dtype=torch.int32)
    words = src.numpy()
    for programs, block in ((1, 64), (3, 64), (7, 32), (40, 16)):
        got = read_words(src, programs, block, 1, 1).numpy()
        per = math.ceil(math.ceil(1000 / programs) / block) * block
        want = [np.bitwise_xor.reduce(words[i : i + per]) for i in range(0, 1000, per)]
        assert got.tolist() == [int(w) for w in want], (programs, block)
        assert xor_all(torch.from_numpy(got)) == xor_all(src)
