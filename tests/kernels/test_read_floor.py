"""The read floor of `benchmarks/quant_kernels.py` (`benchmarks/read_floor.py`: kernels that only
read a layer's bytes, the cost any one-row GEMV over them meets), on the tests' device (the
interpreter on the CPU)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def test_the_read_floor_kernel_reads_every_word_once(device):
    """`_read_kernel` (the read floor): each program's xor is that of its own slice, at program
    counts that leave a ragged last slice, and fewer programs than asked for where whole
    blocks cover the words sooner."""
    import numpy as np

    from benchmarks.read_floor import read_words, xor_all

    gen = torch.Generator().manual_seed(0)
    src = torch.randint(-(2**31), 2**31 - 1, (1000,), generator=gen, dtype=torch.int32)
    words = src.numpy()
    for programs, block in ((1, 64), (3, 64), (7, 32), (40, 16)):
        got = read_words(src.to(device), programs, block, 1, 1).cpu().numpy()
        per = math.ceil(math.ceil(1000 / programs) / block) * block
        want = [np.bitwise_xor.reduce(words[i : i + per]) for i in range(0, 1000, per)]
        assert got.tolist() == [int(w) for w in want], (programs, block)
        assert xor_all(torch.from_numpy(got)) == xor_all(src)


def test_the_rows_read_loads_what_the_int4_gemv_loads(device):
    """`_read_rows_kernel` (the int4 GEMV's access pattern): program (row block, split) xors
    each of its rows' code words over its split's 128-input blocks and the meta word of each
    group it starts, with ragged row blocks, an empty last split and either grid order."""
    import numpy as np

    from benchmarks.read_floor import read_rows

    gen = torch.Generator().manual_seed(1)
    n, kb = 40, 5
    q = torch.randint(-(2**31), 2**31 - 1, (n, kb * 16), generator=gen, dtype=torch.int32)
    meta = torch.randint(-(2**31), 2**31 - 1, (kb, n), generator=gen,
                         dtype=torch.int32)  # fmt: skip
    words, metas = q.numpy().reshape(n, kb, 16), meta.numpy()
    for block_n, block_k, split_k, splits_first in ((16, 128, 2, False), (32, 256, 4, True)):
        cfg = (block_n, block_k, split_k, 4, 1, splits_first)
        got = read_rows(q.to(device), meta.to(device), 128, cfg).cpu().numpy()
        subs = block_k // 128
        per = math.ceil(math.ceil(kb / split_k) / subs) * subs
        for split in range(split_k):
            blocks = range(split * per, min(split * per + per, kb))
            for row in range(n):
                want = np.int32(0)
                for b in blocks:
                    want ^= np.bitwise_xor.reduce(words[row, b]) ^ metas[b, row]
                assert got[split, row] == want, (block_n, split, row)
