"""Messages the scheduler receives."""

from __future__ import annotations

from dataclasses import dataclass, field

from braid.runtime.sampling_params import SamplingParams


@dataclass
class PixelRecipe:
    """How an image's uint8 pixels become its image processor's float32 output, to the bit (as
    transformers' numpy code computes it): each value v of channel c becomes
    float32(v * rescale) (the product in float64), then (that - mean[c]) / std[c] in float32;
    then, with `patch` = [temporal_patch_size, patch_size, merge_size] (the Qwen2-VL family),
    the [channels, height, width] image is cut into flattened patches, Qwen2-VL's layout."""

    rescale: float
    mean: list[float]
    std: list[float]
    patch: list[int] | None = None


@dataclass
class ImageInput:
    """One image of a prompt, processed: its pixels as raw bytes (C order) with their shape and
    dtype beside them, how many prompt tokens stand for it and where the first of them is in
    `input_ids`, and its content hash (see `image_data.ImageData`). With a `recipe` the pixels
    are the processor's uint8 image, before the steps the recipe names."""

    data: bytearray  # decoded into a buffer of its own, which the pixel tensor then wraps
    shape: list[int]
    dtype: str
    num_tokens: int
    offset: int
    hash: int
    grid_thw: list[int] | None = None
    image_size: list[int] | None = None
    recipe: PixelRecipe | None = None


@dataclass
class EmbedSpec:
    """An embedding request: pool the prompt's final hidden states (after the model's last
    norm) into one vector instead of generating. `pooling`: "last" (the last token's),
    "mean" (over every prompt position) or "cls" (the first token's); `dimensions`: keep the
    vector's first this many values (Matryoshka truncation; None: all); `normalize`: then
    scale it to unit L2 norm."""

    pooling: str
    normalize: bool
    dimensions: int | None = None


@dataclass
class GenerateReq:
    """A tokenized request: generate one sample for `input_ids`.

    `seed` is the 32-bit noise stream of this sample (already folded; see
    `sampling_params.fold_seed`).
    `session_id`: the program session it belongs to; when it finishes, its whole sequence stays
    pinned in the prefix cache for that session (replacing the session's previous pin) until a
    `ControlReq("close_session", session_id)`.
    `program_id`: the program run it belongs to (default: the root of `session_id`), for
    program-aware scheduling (`scheduler/programs.py`).
    `program_position`: the call's position in its program run (0 for its first gen or select,
    then 1, ...; a fork's branches each count on from the parent's next position), for the
    program's accounting; None: not known (each request then counts as a call of its own).
    `session_ttl_s`: how long the session's pin lasts after this request (capped by the
    `session_ttl_s` setting); None: as long as the program's pauses suggest (`pin_ttl`).
    `images`: the prompt's images in order; `input_ids` already holds each one's image tokens.
    `embed`: pool the prompt into an embedding (no token is sampled; `params` is ignored but
    for its defaults), returned in the request's one `TokenOut.embedding`.
    `grammar_after`: the output constraint (if any) applies only once the output has ended
    with these tokens (a reasoning model's end of thinking); empty: from the first token.
    `grammar_open`: with `grammar_after`, the token that opens the thinking when the model may
    or may not think (Qwen3): the first token is then the grammar's or this one, and only this
    one defers the grammar to `grammar_after`.
    `cache_salt`: the prefix cache keys this prompt with the salt (vLLM's field), so only
    requests with the same salt share its KV (tenants cannot time each other's prompts).
    `priority`: under the `priority` schedule policy, requests of a lower value are admitted
    first and retracted last (vLLM's field); any other policy refuses a value other than 0.
    """

    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int
    session_id: str | None = None
    images: list[ImageInput] = field(default_factory=list)
    grammar_after: list[int] = field(default_factory=list)
    grammar_open: int | None = None
    program_id: str | None = None
    session_ttl_s: float | None = None
    embed: EmbedSpec | None = None
    program_position: int | None = None
    cache_salt: str | None = None
    priority: int = 0


@dataclass
class GenerateBatch:
    """Requests sent together (an offline batch, a prompt's samples): the scheduler admits
    them in one loop iteration, so how they are batched does not depend on how busy the
    machine is while they are sent."""

    reqs: list[GenerateReq]


@dataclass
class AbortReq:
    rid: str


@dataclass
class ControlReq:
    """An operator request answered with a `ControlOut` carrying the same `req_id`.

    `op`: "stats" (counters and KV usage), "flush_cache", "check_invariants" (the KV
    accounting check tests and operators use), "close_session" (`arg`: the session id), or
    "end_program" (`arg`: a program id sent without a session: its run has ended), or
    "log_throughput" (`arg`: seconds between the scheduler's throughput lines; empty: off)."""

    req_id: int
    op: str
    arg: str | None = None


@dataclass
class ShutdownReq:
    pass
