"""How `select` turns log-probabilities into a decision.

Every backend scores all choices in one batched request and hands a method, per choice, the
log-probabilities of the choice's tokens after the prompt (and, for methods that ask, the same
tokens scored without the prompt). The method returns the index of the chosen option and the
scores it compared.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class ChoicesDecision:
    index: int
    scores: list[float]  # one per choice, higher is better


class ChoicesMethod:
    """A scoring rule. `requires_unconditional`: the backend must also score each choice's
    tokens without the prompt."""

    name = "base"
    requires_unconditional = False

    def scores(
        self, conditional: list[list[float]], unconditional: list[list[float]] | None
    ) -> list[float]:
        raise NotImplementedError

    def __call__(
        self,
        conditional: list[list[float]],
        unconditional: list[list[float]] | None = None,
        temperature: float = 0.0,
        rng: random.Random | None = None,
    ) -> ChoicesDecision:
        if not conditional or any(not lp for lp in conditional):
            raise ValueError("select: every choice needs at least one scored token")
        scores = self.scores(conditional, unconditional)
        if temperature and temperature > 0:
            top = max(scores)
            weights = [math.exp((s - top) / temperature) for s in scores]
            index = (rng or random.Random()).choices(range(len(scores)), weights)[0]
        else:
            index = max(range(len(scores)), key=lambda i: scores[i])  # first among equals
        return ChoicesDecision(index, scores)

    def __repr__(self) -> str:
        return self.name


class TokenLengthNormalized(ChoicesMethod):
    """The mean log-probability per token: long choices are not penalised for their length."""

    name = "token_length_normalized"

    def scores(self, conditional, unconditional):
        return [sum(lp) / len(lp) for lp in conditional]


class GreedyTokenSelection(ChoicesMethod):
    """Walk the choices token by token, keeping those whose token is the most likely at each
    position; a choice that ends early is extended by its own mean so a prefix of a longer
    choice competes fairly. Scores are the per-position log-probabilities' ranks flattened
    into one number (the survivor scores 0, the others -(position they dropped out + 1))."""

    name = "greedy_token_selection"

    def scores(self, conditional, unconditional):
        width = max(len(lp) for lp in conditional)
        padded = [lp + [sum(lp) / len(lp)] * (width - len(lp)) for lp in conditional]
        alive = list(range(len(padded)))
        dropped = [0.0] * len(padded)
        for pos in range(width):
            best = max(padded[i][pos] for i in alive)
            keep = [i for i in alive if padded[i][pos] == best]
            for i in alive:
                if i not in keep:
                    dropped[i] = -(width - pos)
            alive = keep
            if len(alive) == 1:
                break
        return dropped


class UnconditionalLikelihoodNormalized(ChoicesMethod):
    """The mean of (log p(token | prompt) - log p(token | choice alone)): a choice that is
    likely anywhere does not win just for being common."""

    name = "unconditional_likelihood_normalized"
    requires_unconditional = True

    def scores(self, conditional, unconditional):
        if unconditional is None:
            raise ValueError(f"{self.name} needs unconditional scores")
        return [
            sum(c - u for c, u in zip(cond, unc)) / len(cond)
            for cond, unc in zip(conditional, unconditional)
        ]


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
