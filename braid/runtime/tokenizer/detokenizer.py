"""Incremental detokenization of one output stream, with stop strings and stop regexes applied
on the text.

Text is produced as tokens arrive, never emitting a half-decoded multi-byte character: a
token whose bytes do not yet complete a character is held until they do, or until the request
ends (`finish`), when what is held is decoded as it stands (a broken character becomes U+FFFD,
as in SGLang's final output and `tokenizer.decode`). A few prompt tokens
are kept as context so that the first generated token gets its leading space right.

With `min_tokens`, stop strings and stop regexes are looked for from the next token on, as in
vLLM: a match must end in text added after that of the first `min_tokens` tokens. One lying
wholly in that text never ends the request and stays in the output; one that begins there and is
completed by a later token ends it, and is cut where it begins.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from braid.runtime.ipc.to_detokenizer import CONTEXT_TOKENS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# A stop regex must match within the last this many characters of the output.
STOP_REGEX_WINDOW = 4096


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        stop_regex: tuple[str, ...] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.stop_regex = tuple(re.compile(p) for p in stop_regex)
        self.include_stop = include_stop_str_in_output
        self.min_tokens = min_tokens
        self._max_stop = max((len(s) for s in stop), default=0)
        self._ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.num_output_tokens = 0
        self.text = ""
        self.stop_reason: str | None = None
        # Text searched for stops (or exempt from them by min_tokens); it may have been streamed.
        self._checked_len = 0
        # The text of the first `min_tokens` tokens, where no stop regex match may end.
        self._min_text_len = 0

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, token_ids: list[int]) -> str:
        """Append generated tokens; returns the text they add (possibly empty). After a stop
        string is found, `stop_reason` is set, `text` is cut there, and nothing more is added."""
        if self.stopped:
            return ""
        before = len(self.text)
        for tid in token_ids:
            self._ids.append(tid)
            self.num_output_tokens += 1
            self._read(final=False)
            if self.num_output_tokens <= self.min_tokens:
                self._min_text_len = len(self.text)
            elif (self.stop and self._check_stop()) or (
                self.stop_regex and self._check_stop_regex()
            ):
                break
            self._checked_len = len(self.text)
        return self.text[before:]

    def finish(self) -> str:
        """The request ended without a stop string: add the text of any tokens still held
        back (the start of a character whose remaining bytes never came), so that `text` is
        the decode of every output token. Returns what it adds."""
        if self.stopped or self._read_offset == len(self._ids):
            return ""
        before = len(self.text)
        self._read(final=True)
        return self.text[before:]

    def _read(self, final: bool) -> None:
        """Append the text of the tokens after `_read_offset`, unless (before the end,
        `final` False) they add nothing yet or end inside a character."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if final or (len(full) > len(prefix) and not full.endswith("\ufffd")):
            self.text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)

    def _check_stop(self) -> bool:
        """Cut the text where the earliest stop string starts, among those that end in text
        added since the last check (each may begin up to its length before it)."""
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, max(0, self._checked_len - len(s) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        self.stop_reason = s
        return True

    def _check_stop_regex(self) -> bool:
        """A stop regex ends the text where its first match ends (the matched text is kept,
        as SGLang does). Text already checked may have been streamed, so the cut never falls
        before it."""
        start = max(0, len(self.text) - STOP_REGEX_WINDOW)
        best: tuple[int, re.Pattern] | None = None
        for pattern in self.stop_regex:
            end = self._regex_match_end(pattern, start)
            if end is not None and (best is None or end < best[0]):
                best = (end, pattern)
        if best is None:
            return False
        end, pattern = best
        self.text = self.text[: max(end, self._checked_len)]
        self.stop_reason = pattern.pattern
        return True

    def _regex_match_end(self, pattern: re.Pattern, pos: int) -> int | None:
        """Where the first match from `pos` ends, skipping matches that end inside the text of
        the first `min_tokens` tokens (a later one may overlap them)."""
        while (m := pattern.search(self.text, pos)) is not None:
            if not self.min_tokens or m.end() > self._min_text_len:
                return m.end()
            pos = m.start() + 1
        return None

    def stream_safe_len(self) -> int:
        """How much of `text` may be streamed now: while running, a tail that could be the
        start of a stop string is held back, also within the first `min_tokens` tokens, since a
        stop string completed after them is cut where it begins."""
        if self.stopped or not self.stop:
            return len(self.text)
        for k in range(min(self._max_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return len(self.text) - k
        return len(self.text)
