"""Launch configurations of the extend (prefill) attention kernel (`attention_extend.py`):
`ExtendConfig` (its block sizes, warps, stages and whether it packs a KV head's query heads
into one tile), the configurations measured per GPU (`TUNED_CONFIGS`, written by
benchmarks/tune_extend.py --write-config), and the one a launch uses (`launch_config`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from pathlib import Path

import torch

from braid.kernels._checks import cuda_device_name, next_pow2, tuned_configs

# Query rows of one program's tile (BLOCK_M unpacked, BLOCK_M * GROUP packed): the accumulator
# alone is rows x head_dim float32, in registers.
MAX_TILE_ROWS = 256


@dataclasses.dataclass(frozen=True)
class ExtendConfig:
    """A launch configuration of `extend_attention`.

    `block_m`: new tokens per program (a packed tile has `block_m * GROUP` rows, at most
    `MAX_TILE_ROWS` either way); `block_n`: keys per step, dividing `block_m` (the causal part's
    unmasked key blocks must end where the program's tokens begin); both powers of two from 16
    (`tl.dot`'s least size). `pack`: 1 for one program per KV head holding all GROUP query heads
    (the module's docstring), 0 for one program per query head. As JSON (`TUNED_CONFIGS`,
    benchmarks/tune_extend.py's results) it is `[block_m, block_n, num_warps, num_stages]`, with
    `pack` as a fifth field when packed; a four-field entry is unpacked. A value that breaks these
    rules raises `ValueError` naming it.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    pack: int = 0

    def __post_init__(self) -> None:
        for name, value in dataclasses.asdict(self).items():
            if not isinstance(value, int):
                raise ValueError(f"extend_attention config: {name} must be an int, got {value!r}")
        for name, value in (("BLOCK_M", self.block_m), ("BLOCK_N", self.block_n)):
            if value < 16 or value & (value - 1):
                raise ValueError(
                    f"extend_attention: {name} must be a power of two >= 16, got {value}"
                )
        if self.block_m % self.block_n:
            raise ValueError(
                f"extend_attention: BLOCK_N {self.block_n} must divide BLOCK_M {self.block_m}"
            )
        if self.block_m > MAX_TILE_ROWS:
            raise ValueError(
                f"extend_attention: BLOCK_M {self.block_m} exceeds {MAX_TILE_ROWS} tile rows"
            )
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(
                f"extend_attention: num_warps must be a power of two, got {self.num_warps}"
            )
        if self.num_stages < 1:
            raise ValueError(f"extend_attention: num_stages must be >= 1, got {self.num_stages}")
        if self.pack not in (0, 1):
            raise ValueError(f"extend_attention: pack must be 0 or 1, got {self.pack!r}")

    @classmethod
    def from_fields(cls, fields: Sequence[int]) -> ExtendConfig:
        """From the JSON form: four fields (unpacked) or five (the last is `pack`)."""
        if not isinstance(fields, (list, tuple)) or len(fields) not in (4, 5):
            raise ValueError(
                "extend_attention config must be (BLOCK_M, BLOCK_N, num_warps, num_stages"
                f"[, pack]), got {fields!r}"
            )
        return cls(*fields)

    def fields(self) -> list[int]:
        """The JSON form: four fields unpacked, five (ending in 1) packed."""
        fields = [self.block_m, self.block_n, self.num_warps, self.num_stages]
        return fields + [1] if self.pack else fields

    def rows(self, group: int) -> int:
        """Query rows of a program's tile where GROUP query heads share a KV head."""
        return self.block_m * group if self.pack else self.block_m

    def unfit(self, group: int) -> str | None:
        """Why this configuration cannot run where `group` query heads share a KV head; None
        where it can (an unpacked one runs with any)."""
        if not self.pack:
            return None
        if group & (group - 1):
            return f"pack=1 needs GROUP (query heads per KV head) a power of two, got GROUP {group}"
        if self.rows(group) > MAX_TILE_ROWS:
            return (
                f"pack=1 with BLOCK_M {self.block_m} and GROUP {group} makes "
                f"{self.rows(group)} tile rows, more than {MAX_TILE_ROWS}"
            )
        return None


# Launch configurations measured per GPU by benchmarks/tune_extend.py (`--write-config`):
# {device name: {tuned_key: ExtendConfig.fields()}}. A packed config is measured at one GROUP
# and recorded under that GROUP's key; the key without a GROUP holds the best unpacked one.
TUNED_CONFIGS = Path(__file__).parent / "configs" / "extend_attention.json"


def tuned_key(head_dim: int, dtype: torch.dtype, group: int | None = None) -> str:
    """The key of a head size and dtype in `TUNED_CONFIGS` ("128/bfloat16"), with `group`
    query heads per KV head for an entry that holds for that GROUP alone ("128/bfloat16/g4")."""
    key = f"{next_pow2(head_dim)}/{str(dtype).removeprefix('torch.')}"
    return key if group is None else f"{key}/g{group}"


@functools.cache
def _tuned(device_name: str, key: str) -> ExtendConfig | None:
    fields = tuned_configs(TUNED_CONFIGS, device_name).get(key)
    if not fields:
        return None
    try:
        return ExtendConfig.from_fields(fields)
    except ValueError as e:
        raise ValueError(f"tuned kernel configurations {TUNED_CONFIGS}: {key}: {e}") from e


def launch_config(
    head_dim: int, dtype: torch.dtype, device: torch.device, group: int, tuned: bool = True
) -> ExtendConfig:
    """The configuration tuned for this GPU, head size and dtype (`TUNED_CONFIGS`; `tuned=False`
    skips it), for this `group` where one was measured at it, else for any GROUP; else an
    unpacked one by head size (float32 tiles take twice the registers). A tuned entry that
    cannot run with this `group` (a packed one, hand-written) gives way rather than failing
    the launch."""
    block_d = next_pow2(head_dim)
    if tuned and device.type == "cuda":
        name = cuda_device_name(device.index)
        for key in (tuned_key(head_dim, dtype, group), tuned_key(head_dim, dtype)):
            config = _tuned(name, key)
            if config is not None and config.unfit(group) is None:
                return config
    if block_d <= 128:
        m, n, warps = 64, 64, 4
    else:
        m, n, warps = 32, 32, 8
    if dtype == torch.float32 and device.type == "cuda":
        m, n = max(16, m // 2), max(16, n // 2)
    return ExtendConfig(m, n, warps, 1)
