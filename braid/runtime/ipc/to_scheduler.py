"""Messages the scheduler receives."""

from __future__ import annotations

from dataclasses import dataclass

from braid.runtime.sampling_params import SamplingParams


@dataclass
class GenerateReq:
    """A tokenized request: generate one sample for `input_ids`.

    `seed` is the 32-bit noise stream of this sample (already folded; see sampler.fold_seed).
    """

    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int


@dataclass
class AbortReq:
    rid: str


@dataclass
class ControlReq:
    """An operator request answered with a `ControlOut` carrying the same `req_id`.

    `op`: "stats" (counters and KV usage), "flush_cache", or "check_invariants" (the KV
    accounting check tests and operators use)."""

    req_id: int
    op: str


@dataclass
class ShutdownReq:
    pass
