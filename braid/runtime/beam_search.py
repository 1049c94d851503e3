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

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from braid.runtime.errors import ParamError
from braid.runtime.offline_prompts import Prompt, progress, prompt_list
from braid.runtime.outputs import PositionLogprobs
from braid.runtime.sampling_params import MAX_LOGPROBS, SamplingParams


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
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise ParamError.at("length_penalty", f"must be a finite number, got {lp!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0:
            raise ParamError.at("temperature", f"must be a number >= 0, got {t!r}")


@dataclass
class BeamSearchSequence:
    """One beam: its tokens (the prompt's, then the generated ones), each generated
    position's log-probabilities (the chosen token and the other candidates), their sum, and,
    once returned, its text (the whole sequence decoded), `finish_reason` ("stop" for an EOS,
    "length", "abort") and `stop_reason` (vLLM's field; None, as for an EOS in `generate`)."""

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
    """`cum_logprob / length ** length_penalty`; for a penalty that takes the power past the
    float range, the limit (0 for an infinite power, -inf for one that rounds to 0)."""
    length = len(beam.tokens) - (beam.tokens[-1] in eos and beam.finish_reason == "stop")
    if beam.cum_logprob == 0:
        return 0.0
    try:
        power = float(max(length, 1)) ** length_penalty
    except OverflowError:
        power = math.inf
    return beam.cum_logprob / power if power else -math.inf


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
                    child.finish_reason = "stop"  # stop_reason None: an EOS, as generate's
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

    def abort(self) -> None:
        """End the search now (a step was aborted): the live beams end with "abort"."""
        for beams in self.live:
            for b in beams:
                b.finish_reason = "abort"
        self.steps = self.params.max_tokens

    def kept(self, beam: BeamSearchSequence) -> list[int]:
        """The beam's tokens its text shows: an ended beam's EOS only if asked for."""
        if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
            return beam.tokens[:-1]
        return beam.tokens


def beam_search(
    llm: Any,
    prompts: Any,
    params: BeamSearchParams,
    lora_request: None = None,
    use_tqdm: bool | Callable[..., Any] = False,
    concurrency_limit: int | None = None,
) -> list[BeamSearchOutput]:
    """`LLM.beam_search`: the best `params.beam_width` continuations of each prompt (text or
    token ids) through the offline engine `llm`, each a `BeamSearchSequence` (see the
    module's docstring); at most `concurrency_limit` prompts searched at once (vLLM's).
    `lora_request` is vLLM's and must be None (braid serves no adapters)."""
    if lora_request is not None:
        raise ParamError.at("lora_request", "braid serves no LoRA adapters")
    bar = progress(use_tqdm, total=len(prompt_list(prompts)), desc="Beam search")
    try:
        return _search(llm, prompts, params, bar, concurrency_limit)
    finally:
        bar.close()


def _search(
    llm: Any, prompts: Any, params: BeamSearchParams, bar: Any, concurrency_limit: int | None
) -> list[BeamSearchOutput]:
    if not isinstance(params, BeamSearchParams):
        raise ParamError("params", f"params must be a BeamSearchParams, got {params!r}")
    params.check()
    limit = concurrency_limit
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ParamError.at("concurrency_limit", f"must be an integer >= 1, got {limit!r}")
    items = llm._read_prompts(prompts)
    probe = SamplingParams(max_tokens=1)
    for i, item in enumerate(items):
        if item.sources:
            raise ParamError("prompt", f"prompt {i}: beam search takes text only")
        llm.tm.validate(item.ids, probe, where=f"prompt {i}")  # room for one token at least
    limit = limit or max(len(items), 1)
    results: list[BeamSearchOutput] = []
    for start in range(0, len(items), limit):
        chunk = items[start : start + limit]
        search = BeamSearch([it.ids for it in chunk], params, llm.eos_token_ids, llm.context_length)
        step = search.step_params()
        while (batch := search.batch()) is not None:
            now = [Prompt(None, ids, cache_salt=chunk[p].cache_salt) for p, ids in batch]
            outs = llm._run(now, [step] * len(batch), use_tqdm=False)
            positions = []
            for (p, _), out in zip(batch, outs):
                sample = out.outputs[0]
                if sample.finish_reason == "abort" or not sample.logprobs:
                    raise RuntimeError(f"beam search: prompt {start + p}: a step was aborted")
                positions.append(sample.logprobs[0])
            search.advance(positions)
        tok = llm.tokenizer
        results += search.results(tok.decode if tok is not None else None)
        bar.update(len(chunk))
    return results
