"""A request's state inside the scheduler, and the one table that holds every request."""

from __future__ import annotations

import enum
import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from braid.runtime.cache.radix_cache import TreeNode
from braid.runtime.constrained.grammar import GrammarMatcher
from braid.runtime.errors import ParamError
from braid.runtime.executor.sampler import SamplingInput
from braid.runtime.image_data import ImageData, from_wire
from braid.runtime.ipc.to_scheduler import EmbedSpec, GenerateReq
from braid.runtime.pooling import Pooled
from braid.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from braid.runtime.scheduler.programs import ProgramTable

# M-RoPE positions of a prompt: (the [3, prompt_len] positions, the delta that later positions
# add), computed by the model class from the prompt and its images.
RopeFn = Callable[[list[int], list[ImageData]], tuple[torch.Tensor, int]]


class ReqStatus(enum.Enum):
    """Where a request is in its life; a finished request has left the table."""

    COMPILING = "compiling"  # its grammar compiles in a worker; no KV
    WAITING = "waiting"  # queued for admission (new, or retracted with its output kept); no KV
    PREFILLING = "prefilling"  # admitted: its prompt's KV is being computed (between chunks,
    # or in the extend of the step being run)
    RUNNING = "running"  # decoding
    JUMPED = "jumped"  # decoding, holding jump-forward tokens whose KV the next extend computes


@dataclass(eq=False)  # a request is itself: list membership tests compare identity
class Req:
    """One sample being generated.

    The first `kv_len` tokens of the sequence (prompt, then output) have KV, in `pages`, or
    will have once the forwards already queued on the device have run (a decode counts its
    token from launch; see `scheduler/overlap.py`), so anything queued later may read it. The
    first `shared_pages` of those pages belong to the prefix cache (locked through
    `cache_node`); the rest belong to this request. `cached_tokens` is how many prompt tokens
    the cache supplied at first admission.
    """

    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int
    eos_ids: frozenset[int]
    max_new_tokens: int
    output_ids: list[int] = field(default_factory=list)
    pool_row: int | None = None
    pages: list[int] = field(default_factory=list)
    kv_len: int = 0
    shared_pages: int = 0
    cache_node: TreeNode | None = None
    cached_tokens: int = 0
    admitted_once: bool = False
    held_whole: bool = False  # held back once, in its life, for a step that takes it whole
    retractions: int = 0
    error: str | None = None
    detok_sent: bool = False  # whether the detokenizer has been told how to decode it
    grammar: GrammarMatcher | None = None  # the output constraint, once compiled and active
    # The constraint applies once the output ends with `grammar_after` (the end of a reasoning
    # model's thinking); until then its compiled matcher waits here.
    grammar_after: tuple[int, ...] = ()
    waiting_grammar: GrammarMatcher | None = None
    # The token that opens the thinking, when the first token decides whether there is any:
    # the grammar's tokens or this one may come first (`GenerateReq.grammar_open`).
    grammar_open: int | None = None
    reported: int = 0  # output tokens already sent out in a TokenOut
    # Output tokens the model chose: the rest are jump-forward tokens of a greedy request that
    # the next extend's logits verify (see `GrammarManager.verify`), not reported until then.
    verified: int = 0
    prompt_logprobs_sent: bool = False
    finish_reason: str | None = None
    stop_token: int | None = None
    session_id: str | None = None  # the program session whose KV stays pinned after it
    program_id: str | None = None  # the program run it belongs to (see `programs.py`)
    program_position: int | None = None  # the call's position in its program run
    session_ttl_s: float | None = None  # the client's TTL for its session pin (else adaptive)
    session_closed: bool = False  # its session was closed while it ran: it pins nothing
    waiting_since: float = 0.0  # when it last entered the waiting queue (the table's clock)
    # Leading tokens its program has had computed before (the longest prefix its prompt shares
    # with a sequence the program remembers, then this request's own KV): computing them
    # again is not service (`programs.ProgramTable.serve`).
    program_seen: int = 0
    status: ReqStatus | None = None  # None: not (or no longer) in a `RequestTable`
    # The prompt's images, in order, and where each one's tokens start in `input_ids`.
    images: list[ImageData] = field(default_factory=list)
    image_offsets: list[int] = field(default_factory=list)
    # M-RoPE (Qwen2-VL family) with images: the prompt's [3, prompt_len] positions; every later
    # position p is rotated as p + rope_delta. None: 1-D positions.
    rope_positions: torch.Tensor | None = None
    rope_delta: int = 0
    # Speculative decoding: decode steps taken, draft tokens verified, and kept.
    spec_steps: int = 0
    spec_drafts: int = 0
    spec_accepted: int = 0
    # An embedding request: its prefill's final hidden states are pooled (`pooled`, fed chunk
    # by chunk) instead of sampling a token; it finishes when its prompt is computed.
    embed: EmbedSpec | None = None
    pooled: Pooled | None = None
    cache_salt: str | None = None  # the prefix cache's key of its first token is salted
    priority: int = 0  # under the `priority` policy: lower values go first, leave last

    def __post_init__(self) -> None:
        assert self.input_ids, "a request needs at least one prompt token"
        assert self.max_new_tokens >= 0  # 0: prefill only
        if self.embed is not None:
            assert self.max_new_tokens == 0, "an embedding request generates nothing"
            self.pooled = Pooled(self.embed.pooling)
        assert len(self.images) == len(self.image_offsets)
        # The prefix cache's view of the prompt: an image's tokens carry a value derived from
        # its content hash (negative, so never a vocabulary id), so the same image shares KV
        # and a different one never matches.
        self._cache_prompt = self.input_ids
        if self.images:
            self._cache_prompt = list(self.input_ids)
            for image, start in zip(self.images, self.image_offsets):
                self._cache_prompt[start : start + image.num_tokens] = [-1 - image.hash] * (
                    image.num_tokens
                )
        if self.cache_salt is not None:
            # Radix matches are prefixes: a salted first key keeps the whole prompt apart.
            self._cache_prompt = list(self._cache_prompt)
            self._cache_prompt[0] = salted_key(self.cache_salt, self._cache_prompt[0])
        self._sampling = SamplingInput(
            params=self.params,
            seed=self.seed,
            prompt_ids=self.input_ids,
            output_ids=self.output_ids,
            stop_ids=sorted(self.eos_ids | set(self.params.stop_token_ids)),
        )

    @classmethod
    def from_message(
        cls,
        msg: GenerateReq,
        context_length: int,
        vocab_size: int,
        eos_ids: frozenset[int],
        image_token_id: int | None = None,
        rope: RopeFn | None = None,
        check_image: Callable[[ImageData], None] | None = None,
    ) -> Req:
        """The request `msg` asks for, its output capped by the context; a prompt that is
        empty, leaves no room, or holds a token outside the vocabulary is a `ParamError`, as
        are images for a model without `image_token_id` and images whose tokens are not that
        token, or that `check_image` (the model's) refuses. `rope` gives the M-RoPE positions of
        a prompt with images."""
        n = len(msg.input_ids)
        if n == 0:
            raise ParamError.at("prompt", "must contain at least one token")
        if msg.embed is not None:
            if msg.images:
                raise ParamError.at("images", "embeddings take text only")
            dims = msg.embed.dimensions
            if dims is not None and dims < 1:
                raise ParamError.at("dimensions", f"must be a positive integer, got {dims}")
            if n > context_length:
                raise ParamError.at(
                    "input", f"{n} tokens is longer than the context length ({context_length})"
                )
        elif n >= context_length:
            raise ParamError.at(
                "prompt",
                f"{n} tokens leave no room to generate within the context length "
                f"({context_length})",
            )
        if max(msg.input_ids) >= vocab_size or min(msg.input_ids) < 0:
            raise ParamError.at("prompt", f"token ids must be in [0, {vocab_size})")
        # The front ends check these too; a sampler index past the vocabulary would fail a step.
        msg.params.check_token_ids(vocab_size)
        if msg.program_position is not None and msg.program_position < 0:
            raise ParamError.at("program_position", f"must be >= 0, got {msg.program_position}")
        images = [from_wire(m) for m in msg.images]
        if msg.cache_salt is not None:
            # The encoder cache keys tower outputs by image hash: salted too, so a tenant's
            # image never comes back faster for another (and its span's cache key follows).
            for image in images:
                image.hash = salted_key(msg.cache_salt, image.hash) & ((1 << 63) - 1)
        offsets = [m.offset for m in msg.images]
        if images and image_token_id is None:
            raise ParamError.at("images", "this model takes text only")
        end = 0
        for i, (image, start) in enumerate(zip(images, offsets)):
            if check_image is not None:
                try:
                    check_image(image)
                except ValueError as e:
                    raise ParamError.at(f"images[{i}]", str(e)) from None
            span = msg.input_ids[start : start + image.num_tokens]
            if start < end or len(span) != image.num_tokens or set(span) != {image_token_id}:
                raise ParamError.at(
                    f"images[{i}]",
                    f"its {image.num_tokens} image tokens are not at {start} in the prompt",
                )
            end = start + image.num_tokens
        rope_positions, rope_delta = None, 0
        if images and rope is not None:
            try:
                rope_positions, rope_delta = rope(list(msg.input_ids), images)
            except (TypeError, IndexError, RuntimeError) as e:
                raise ParamError.at("images", f"no M-RoPE positions for them: {e}") from None
        max_new = context_length - n
        if msg.embed is not None:
            max_new = 0
        elif msg.params.max_tokens is not None:
            max_new = min(max_new, msg.params.max_tokens)
        return cls(
            rid=msg.rid,
            input_ids=list(msg.input_ids),
            params=msg.params,
            seed=msg.seed,
            eos_ids=eos_ids,
            max_new_tokens=max_new,
            session_id=msg.session_id,
            program_id=msg.program_id,
            program_position=msg.program_position,
            session_ttl_s=msg.session_ttl_s,
            grammar_after=tuple(msg.grammar_after),
            grammar_open=msg.grammar_open if msg.grammar_after else None,
            images=images,
            image_offsets=offsets,
            rope_positions=rope_positions,
            rope_delta=rope_delta,
            embed=msg.embed,
            cache_salt=msg.cache_salt,
            priority=msg.priority,
        )

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    def hold_grammar(self) -> None:
        """Keep the compiled grammar aside until the output reaches `grammar_after`."""
        if self.grammar_after and not self._reached_grammar():
            self.waiting_grammar, self.grammar = self.grammar, None

    @property
    def grammar_undecided(self) -> bool:
        """Whether the first token decides if the grammar waits (see `grammar_open`)."""
        return (
            self.waiting_grammar is not None
            and self.grammar_open is not None
            and (not self.output_ids)
        )

    def decide_grammar(self) -> None:
        """After the first token: unless it opened the thinking, the grammar applies from it
        (it was sampled under the grammar's mask, widened by the opening token)."""
        if self.grammar_open is None or len(self.output_ids) != 1:
            return
        if self.output_ids[0] != self.grammar_open and self.waiting_grammar is not None:
            self.grammar, self.waiting_grammar = self.waiting_grammar, None
        self.grammar_open = None

    def release_grammar(self) -> bool:
        """Make the waiting grammar the active one if the output has just reached
        `grammar_after`; whether it did."""
        if self.waiting_grammar is None or not self._reached_grammar():
            return False
        self.grammar, self.waiting_grammar = self.waiting_grammar, None
        return True

    def _reached_grammar(self) -> bool:
        n = len(self.grammar_after)
        return len(self.output_ids) >= n and tuple(self.output_ids[-n:]) == self.grammar_after

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def sampling(self) -> SamplingInput:
        return self._sampling

    def tokens(self, end: int | None = None) -> list[int]:
        """The sequence (prompt then output) up to `end`."""
        seq = self.input_ids + self.output_ids
        return seq if end is None else seq[:end]

    def cache_tokens(self, end: int | None = None) -> list[int]:
        """The sequence up to `end` as the prefix cache keys it: `tokens()`, with each image's
        tokens replaced by a value of its content hash."""
        seq = self._cache_prompt + self.output_ids
        return seq if end is None else seq[:end]

    @property
    def unverified(self) -> int:
        return len(self.output_ids) - self.verified

    def take_unreported(self) -> list[int]:
        """Verified output tokens not yet sent out (the sampled one, plus any jump-forward
        tokens that need no verifying), marked as sent."""
        new = self.output_ids[self.reported : self.verified]
        self.reported = self.verified
        return new

    @property
    def remaining_new_tokens(self) -> int:
        return self.max_new_tokens - len(self.output_ids)

    def check_finished(self, token: int) -> None:
        """Set `finish_reason` if `token` (just appended) ends the request (an EOS first, as
        vLLM checks it: an EOS also among `stop_token_ids` reports no stop token)."""
        if token in self.eos_ids and not self.params.ignore_eos:
            self.finish_reason = "stop"
        elif token in self.params.stop_token_ids:
            self.finish_reason, self.stop_token = "stop", token
        elif len(self.output_ids) >= self.max_new_tokens:
            self.finish_reason = "length"


class RequestTable:
    """Every request the scheduler holds, by rid, each with exactly one status. The queues are
    views of it, in the order requests entered their status (`move(front=True)` puts a request
    at the head of its status' queue: a retracted request resumes first). Finding a request by
    rid is a lookup; changing status is O(1) except at the front."""

    def __init__(
        self,
        programs: ProgramTable | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._by_rid: dict[str, Req] = {}
        self._queues: dict[ReqStatus, dict[str, Req]] = {s: {} for s in ReqStatus}
        # Per-program accounting: told of every request that enters and leaves.
        self.programs = programs
        self.clock = clock

    def add(self, req: Req, status: ReqStatus) -> None:
        """Take in a new request; a rid already held is a `ValueError`."""
        if req.rid in self._by_rid:
            raise ParamError.at("rid", f"{req.rid!r} is already in use by a request in flight")
        self._by_rid[req.rid] = req
        self._queues[status][req.rid] = req
        req.status = status
        req.waiting_since = self.clock()
        if self.programs is not None:
            self.programs.arrive(req)

    def move(self, req: Req, status: ReqStatus, front: bool = False) -> None:
        assert self._by_rid.get(req.rid) is req, f"{req.rid} is not in the table"
        del self._queues[req.status][req.rid]
        queue = self._queues[status]
        if front:
            self._queues[status] = {req.rid: req, **queue}
        else:
            queue[req.rid] = req
        req.status = status
        if status is ReqStatus.WAITING:
            req.waiting_since = self.clock()

    def discard(self, req: Req) -> None:
        """Let a (finished) request go; nothing if it already left."""
        if self._by_rid.get(req.rid) is req:
            del self._by_rid[req.rid]
            del self._queues[req.status][req.rid]
            req.status = None
            if self.programs is not None:
                self.programs.leave(req)

    def get(self, rid: str) -> Req | None:
        return self._by_rid.get(rid)

    def view(self, *statuses: ReqStatus) -> list[Req]:
        """The requests with these statuses, each status' queue in order, in the order given."""
        return [r for s in statuses for r in self._queues[s].values()]

    def first(self, status: ReqStatus) -> Req | None:
        return next(iter(self._queues[status].values()), None)

    def count(self, *statuses: ReqStatus) -> int:
        return sum(len(self._queues[s]) for s in statuses)

    def __len__(self) -> int:
        return len(self._by_rid)

    def __iter__(self) -> Iterator[Req]:
        return iter(list(self._by_rid.values()))


def salted_key(salt: str, key: int) -> int:
    """The prefix cache's key for a first token (or an image's value) `key` under `salt`:
    negative, as image values are, so never a vocabulary id, and a 63-bit hash of both."""
    digest = hashlib.blake2b(f"{salt}\0{key}".encode(), digest_size=8).digest()
    return -1 - (int.from_bytes(digest, "little") >> 1)
