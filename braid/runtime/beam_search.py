"""Offline beam search (vLLM's `LLM.beam_search`), on top of the engine's own generation.

Each step asks the engine for one token of every live beam with the `2 * beam_width` most
likely next tokens and their log-probabilities (the model's own, before any temperature);
the prefix cache holds each beam's tokens from the step before, so a step computes one new
token per beam. Per prompt, every candidate continuation is scored by its cumulative
log-probability; one ending in an EOS token (unless `ignore_eos`) is complete, the best
`beam_width` of the others go on. After `max_tokens` steps (or when no beam is left) the
complete and the live beams are ranked by `cumulative logprob / length ** length_penalty`
(the length counts the prompt, and not a final EOS, as vLLM's) and the best `beam_width`
are returned.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from braid.runtime.errors import ParamError
from braid.runtime.offline_prompts import Prompt
from braid.runtime.outputs import PositionLogprobs
from braid.runtime.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from braid.runtime.engine import LLM


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters. `temperature` is taken for vLLM's signature and changes
    nothing: the beams are scored by the model's own log-probabilities."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def check(self) -> None:
        """A `ParamError` naming the first bad field."""
        bw = self.beam_width
        if isinstance(bw, bool) or not isinstance(bw, int) or not 1 <= bw <= MAX_LOGPROBS // 2:
            raise ParamError.at(
                "beam_width",
                f"must be an integer in [1, {MAX_LOGPROBS // 2}] (each step scores 2 x "
                f"beam_width next tokens, at most {MAX_LOGPROBS}), got {bw!r}",
            )
        n = self.max_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ParamError.at("max_tokens", f"must be an integer >= 1, got {n!r}")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or lp != lp:
            raise ParamError.at("length_penalty", f"must be a number, got {lp!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0:
            raise ParamError.at("temperature", f"must be a number >= 0, got {t!r}")


@dataclass
class BeamSearchSequence:
    """One beam: its tokens (the prompt's, then the generated ones), each generated
    position's log-probabilities (the chosen token and the other candidates), their sum, and,
    once returned, its text (the whole sequence decoded), `finish_reason` ("stop" for an EOS,
    "length") and `stop_reason` (the EOS token id)."""

    tokens: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None


@dataclass
class BeamSearchOutput:
    """The best `beam_width` beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos: frozenset[int], length_penalty: float) -> float:
    length = len(beam.tokens) - (beam.tokens[-1] in eos and beam.finish_reason == "stop")
    return beam.cum_logprob / max(length, 1) ** length_penalty


class BeamSearch:
    """One beam search over token-id prompts, driven by its caller: `batch()` gives the
    sequences to extend by one token (None when the search is over), `advance` takes each
    one's scored next tokens, `results` ranks what is left (see the module's docstring)."""

    def __init__(
        self,
        prompts: list[list[int]],
        params: BeamSearchParams,
        eos_token_ids: frozenset[int],
        context_length: int,
    ) -> None:
        params.check()
        self.params = params
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self.context_length = context_length
        self.prompt_lens = [len(p) for p in prompts]
        self.live = [[BeamSearchSequence(list(p))] for p in prompts]
        self.done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.steps = 0
        self._order: list[tuple[int, BeamSearchSequence]] = []

    def step_params(self) -> SamplingParams:
        """What each sequence of a batch is run with: one token, the most likely candidates."""
        return SamplingParams(
            max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=2 * self.params.beam_width
        )

    def batch(self) -> list[tuple[int, list[int]]] | None:
        """(prompt index, tokens) of every live beam, or None when the search is over. A beam
        the context cannot take one more token of ends here."""
        if self.steps == self.params.max_tokens:
            return None
        for p, beams in enumerate(self.live):
            for b in beams:
                if len(b.tokens) >= self.context_length:
                    b.finish_reason = "length"
                    self.done[p].append(b)
            self.live[p] = [b for b in beams if b.finish_reason is None]
        self._order = [(p, b) for p, beams in enumerate(self.live) for b in beams]
        return [(p, b.tokens) for p, b in self._order] or None

    def advance(self, positions: list[PositionLogprobs]) -> None:
        """The candidates of each sequence of the last `batch()`, in its order."""
        grown: list[list[BeamSearchSequence]] = [[] for _ in self.live]
        for (p, beam), position in zip(self._order, positions, strict=True):
            for token, lp in position.items():
                child = BeamSearchSequence(
                    beam.tokens + [token], beam.logprobs + [position], beam.cum_logprob + lp.logprob
                )
                if token in self.eos:
                    child.finish_reason, child.stop_reason = "stop", token
                    self.done[p].append(child)
                else:
                    grown[p].append(child)
        for p, children in enumerate(grown):
            children.sort(key=lambda b: b.cum_logprob, reverse=True)
            self.live[p] = children[: self.params.beam_width]
        self.steps += 1

    def results(self, decode: Callable[[list[int]], str] | None) -> list[BeamSearchOutput]:
        """The best `beam_width` beams of each prompt, best first, their text decoded by
        `decode` (the whole sequence; an ended beam's EOS left out unless asked to keep it)."""
        out = []
        for p in range(len(self.live)):
            for b in self.live[p]:
                b.finish_reason = b.finish_reason or "length"
            ranked = sorted(
                self.done[p] + self.live[p],
                key=lambda b: beam_score(b, self.eos, self.params.length_penalty),
                reverse=True,
            )[: self.params.beam_width]
            for b in ranked:
                b.text = decode(self.kept(b)) if decode is not None else None
            out.append(BeamSearchOutput(ranked))
        return out

    def kept(self, beam: BeamSearchSequence) -> list[int]:
        """The beam's tokens its text shows: an ended beam's EOS only if asked for."""
        if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
            return beam.tokens[:-1]
        return beam.tokens


def beam_search(
    llm: LLM, prompts: Any, params: BeamSearchParams, use_tqdm: bool = True
) -> list[BeamSearchOutput]:
    """`params.beam_width` best continuations of each prompt (see the module's docstring)."""
    from braid.runtime.engine import progress

    if not isinstance(params, BeamSearchParams):
        raise ParamError("params", f"params must be a BeamSearchParams, got {params!r}")
    params.check()
    items = llm._read_prompts(prompts)
    for i, item in enumerate(items):
        if item.sources:
            raise ParamError("prompt", f"prompt {i}: beam search takes text only")
    search = BeamSearch([item.ids for item in items], params, llm.eos_token_ids, llm.context_length)
    step = search.step_params()
    bar = progress(use_tqdm, total=params.max_tokens, desc="Beam search")
    try:
        while (batch := search.batch()) is not None:
            prompts_now = [Prompt(None, ids, cache_salt=items[p].cache_salt) for p, ids in batch]
            outs = llm._run(prompts_now, [step] * len(batch), use_tqdm=False)
            search.advance([out.outputs[0].logprobs[0] for out in outs])
            bar.update(1)
    finally:
        bar.close()
    tok = llm.tokenizer
    return search.results(tok.decode if tok is not None else None)
