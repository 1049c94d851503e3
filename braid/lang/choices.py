"""How `select` turns log-probabilities into a decision: SGLang's choices-method protocol.

Every backend scores all choices in one batched request. A method is then called with keyword
arguments only, as SGLang calls it:

- `choices`: the options;
- `input_token_logprobs`: per choice, `[logprob, token_id, token_text]` for each of the
  choice's tokens after the prompt (a token that straddles the boundary counts as the
  choice's);
- `normalized_prompt_logprobs`: per choice, the mean of those log-probabilities;
- `output_token_logprobs`: per choice, the log-probabilities of generated tokens (none: a
  select generates nothing, so each is `[]`);
- `unconditional_token_logprobs`: for methods whose `requires_unconditional_logprobs` is true,
  per choice the same tokens scored without the prompt (the first has no context: None).

It returns `ChoicesDecision(decision, meta_info)`: the chosen string and what the program's
meta info for the variable holds. A method written for SGLang plugs in unchanged.

braid's own methods also expose `scores(...)`, one number per choice (higher is better), which
`select(..., temperature > 0)` samples from (a softmax at that temperature); a method without
`scores` is only used greedily.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

TokenLogprobs = list[list[Any]]  # [[logprob, token_id, text], ...] for one choice


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] | None = None


def _argmax_first(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def _values(tokens: TokenLogprobs) -> list[float]:
    return [0.0 if t[0] is None else t[0] for t in tokens]


class ChoicesSamplingMethod(ABC):
    """A select scoring rule (SGLang's interface)."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return False

    @abstractmethod
    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[TokenLogprobs],
        output_token_logprobs: list[TokenLogprobs],
        unconditional_token_logprobs: list[TokenLogprobs] | None = None,
    ) -> ChoicesDecision: ...


class ScoredChoicesMethod(ChoicesSamplingMethod):
    """A method defined by one score per choice: greedy picks the first best, `sample` draws
    with a softmax at a temperature."""

    name = "scored"

    @abstractmethod
    def scores(
        self,
        input_token_logprobs: list[TokenLogprobs],
        unconditional_token_logprobs: list[TokenLogprobs] | None,
    ) -> list[float]: ...

    def extra_meta(self, input_token_logprobs, scores: list[float]) -> dict[str, Any]:
        """Method-specific meta info beside the common keys."""
        return {}

    def __call__(
        self,
        *,
        choices,
        normalized_prompt_logprobs,
        input_token_logprobs,
        output_token_logprobs,
        unconditional_token_logprobs=None,
    ) -> ChoicesDecision:
        scores = self.scores(input_token_logprobs, unconditional_token_logprobs)
        return self._decision(
            _argmax_first(scores),
            scores,
            choices=choices,
            normalized_prompt_logprobs=normalized_prompt_logprobs,
            input_token_logprobs=input_token_logprobs,
            output_token_logprobs=output_token_logprobs,
            unconditional_token_logprobs=unconditional_token_logprobs,
        )

    def sample(self, temperature: float, rng: random.Random, **args: Any) -> ChoicesDecision:
        """The decision drawn with probabilities softmax(scores / temperature); `args` are
        the keywords a method is called with."""
        scores = self.scores(args["input_token_logprobs"], args.get("unconditional_token_logprobs"))
        top = max(scores)
        weights = [math.exp((s - top) / temperature) for s in scores]
        return self._decision(rng.choices(range(len(scores)), weights)[0], scores, **args)

    def _decision(
        self,
        index: int,
        scores: list[float],
        *,
        choices,
        normalized_prompt_logprobs,
        input_token_logprobs,
        output_token_logprobs,
        unconditional_token_logprobs=None,
    ) -> ChoicesDecision:
        meta = {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
            **self.extra_meta(input_token_logprobs, scores),
        }
        if unconditional_token_logprobs is not None:
            meta["unconditional_token_logprobs"] = unconditional_token_logprobs
        return ChoicesDecision(choices[index], meta)

    def __repr__(self) -> str:
        return self.name


class TokenLengthNormalized(ScoredChoicesMethod):
    """The mean log-probability per token: long choices are not penalised for their length."""

    name = "token_length_normalized"

    def scores(self, input_token_logprobs, unconditional_token_logprobs):
        return [sum(_values(t)) / len(t) for t in input_token_logprobs]


class GreedyTokenSelection(ScoredChoicesMethod):
    """Walk the choices token by token, keeping those whose token is the most likely at each
    position; a choice that ends early is extended by its own mean so a prefix of a longer
    choice competes fairly. The score of a choice is 0 for the survivors and -(positions left
    when it dropped out) for the others."""

    name = "greedy_token_selection"

    @staticmethod
    def _matrix(input_token_logprobs) -> list[list[float]]:
        rows = [_values(t) for t in input_token_logprobs]
        width = max(len(r) for r in rows)
        return [r + [sum(r) / len(r)] * (width - len(r)) for r in rows]

    def scores(self, input_token_logprobs, unconditional_token_logprobs):
        matrix = self._matrix(input_token_logprobs)
        width = len(matrix[0])
        alive = list(range(len(matrix)))
        dropped = [0.0] * len(matrix)
        for pos in range(width):
            best = max(matrix[i][pos] for i in alive)
            keep = [i for i in alive if matrix[i][pos] == best]
            for i in alive:
                if i not in keep:
                    dropped[i] = -(width - pos)
            alive = keep
            if len(alive) == 1:
                break
        return dropped

    def extra_meta(self, input_token_logprobs, scores):
        return {"greedy_logprob_matrix": self._matrix(input_token_logprobs)}


class UnconditionalLikelihoodNormalized(ScoredChoicesMethod):
    """The mean of (log p(token | prompt) - log p(token | choice alone)): a choice that is
    likely anywhere does not win just for being common."""

    name = "unconditional_likelihood_normalized"

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def scores(self, input_token_logprobs, unconditional_token_logprobs):
        if unconditional_token_logprobs is None:
            raise ValueError(f"{self.name} needs unconditional token logprobs")
        out = []
        for cond, unc in zip(input_token_logprobs, unconditional_token_logprobs):
            c, u = _values(cond), _values(unc)
            if len(c) != len(u):
                raise ValueError("input and unconditional token logprobs must have one length")
            out.append(sum(a - b for a, b in zip(c, u)) / len(c))
        return out

    def extra_meta(self, input_token_logprobs, scores):
        return {"normalized_unconditional_prompt_logprobs": scores}


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
