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
