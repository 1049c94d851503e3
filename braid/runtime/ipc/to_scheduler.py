"""Messages the scheduler receives."""

from __future__ import annotations

from dataclasses import dataclass

from braid.runtime.sampling_params import SamplingParams


@dataclass
class GenerateReq:
    """A tokenized request: generate one sample for `input_ids`.

    `seed` is the 32-bit noise stream of this sample (already folded; see sampler.fold_seed).
    `session_id`: the program session it belongs to; when it finishes, its whole sequence stays
    pinned in the prefix cache for that session (replacing the session's previous pin) until a
    `ControlReq("close_session", session_id)`.
    """

    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int
    session_id: str | None = None


@dataclass
class AbortReq:
    rid: str


@dataclass
class ControlReq:
    """An operator request answered with a `ControlOut` carrying the same `req_id`.

    `op`: "stats" (counters and KV usage), "flush_cache", "check_invariants" (the KV
    accounting check tests and operators use), or "close_session" (`arg`: the session id)."""

    req_id: int
    op: str
    arg: str | None = None


@dataclass
class ShutdownReq:
    pass
