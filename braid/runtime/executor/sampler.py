"""Batched logit processing and sampling: one set of tensor operations for the whole batch.

Order: the grammar bitmask, then (as vLLM) min-tokens suppression, logit bias, repetition /
frequency / presence penalties, then greedy argmax or temperature, top-k, top-p, min-p and a
draw. Work a batch does not ask for is skipped (no sort without top-k/top-p, no penalty counts
without penalties, no mask without a grammar).

Draws are made with counter-based noise: the noise for (seed, step, token) is a hash of those
three numbers, so a request's samples depend only on its own seed and position, never on the
batch it lands in or on the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from braid.runtime.constrained.bitmask import apply_token_bitmask
from braid.runtime.forward_batch import to_device
from braid.runtime.sampling_params import SamplingParams

_MASK32 = 0xFFFFFFFF


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    # murmur3's finaliser on int64 tensors holding 32-bit values (products wrap, then mask).
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


# Uniforms keep 23 bits of the hash: k + 0.5 with k < 2**23 is exact in float32, so every value
# lies strictly inside (0, 1). With 24 bits, k = 2**24 - 1 rounded to exactly 1.0 (one token in
# 16.7M per draw): its exponential noise was 0, and probs / noise made that token win whatever its
# probability: NaN (= the maximum for argmax) for a token a grammar had banned.
UNIFORM_BITS = 23
# The smallest temperature sampled with: logits divided by less overflow float32 (inf, then
# NaN probabilities and token 0). vLLM raises any 0 < temperature < 1e-2 to 1e-2, the same.
MIN_TEMPERATURE = 1e-2


def bits_to_uniform(x: torch.Tensor) -> torch.Tensor:
    """32-bit hash values (int64 tensor) -> float32 uniforms strictly inside (0, 1)."""
    k = (x >> (32 - UNIFORM_BITS)).to(torch.float32)
    return (k + 0.5) * (1.0 / (1 << UNIFORM_BITS))


def hash_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float32 strictly inside (0, 1), a pure function of (seed, step, token index)."""
    row = _fmix32((seeds + steps * 0x9E3779B9) & _MASK32)
    cols = (torch.arange(vocab, device=seeds.device, dtype=torch.int64) * 0x27D4EB2F) & _MASK32
    x = _fmix32(row[:, None] ^ cols[None, :])
    return bits_to_uniform(x)


@dataclass
class SamplingInput:
    """What the sampler needs to know about one request this step."""

    params: SamplingParams
    seed: int  # 32-bit stream id (see sampling_params.fold_seed)
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    stop_ids: Sequence[int]  # tokens suppressed until min_tokens is reached

    def after(self, tokens: Sequence[int]) -> SamplingInput:
        """This request at the position after `tokens` more output tokens (speculative drafts:
        they count for penalties, `min_tokens` and the draw's step)."""
        if not tokens:
            return self
        output = [*self.output_ids, *tokens]
        return SamplingInput(self.params, self.seed, self.prompt_ids, output, self.stop_ids)


_RESULT_TENSORS = ("next_ids", "logprobs", "ranks", "top_ids", "top_logprobs")


@dataclass
class SampleResult:
    next_ids: torch.Tensor  # [B] int64
    # Present only when some request asked for logprobs: raw-model log-probabilities.
    logprobs: torch.Tensor | None = None  # [B] of the chosen tokens
    ranks: torch.Tensor | None = None  # [B] rank of the chosen token (1 = most likely)
    top_ids: torch.Tensor | None = None  # [B, k]
    top_logprobs: torch.Tensor | None = None  # [B, k]
    _host: SampleResult | None = field(default=None, repr=False)
    _ready: torch.cuda.Event | None = field(default=None, repr=False)

    def copy_to_host_async(self) -> None:
        """On CUDA, queue copies of the results into pinned host memory behind the work that
        computes them, and mark that point in the stream: `on_host()` then waits for this step
        alone, not for forwards queued after it (`.tolist()` on a CUDA tensor would)."""
        if self.next_ids.device.type != "cuda":
            return
        copies = {}
        for name in _RESULT_TENSORS:
            t = getattr(self, name)
            copies[name] = None if t is None else t.to("cpu", non_blocking=True)
        self._host = SampleResult(**copies)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def on_host(self) -> SampleResult:
        """The results, readable without touching the device again (self when never copied)."""
        if self._host is None:
            return self
        self._ready.synchronize()
        return self._host


def _padded(seqs: list[Sequence[int]], pad: int, device) -> torch.Tensor:
    width = max(1, max(len(s) for s in seqs))
    out = torch.full((len(seqs), width), pad, dtype=torch.int64)
    for i, s in enumerate(seqs):
        if s:
            out[i, : len(s)] = torch.as_tensor(s, dtype=torch.int64)
    if device.type == "cuda":
        return out.pin_memory().to(device, non_blocking=True)
    return out.to(device)


def _torch_argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


_NEG_INF = float("-inf")
# Token ids of `allowed_token_ids` lists kept on the device (`Sampler._allowed`): 32 MB.
_ALLOWED_CACHE_IDS = 1 << 22


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        # (id of the list, logits width) -> (the list, so the id stays its own; its ids)
        self._allowed_cache: dict[tuple[int, int], tuple[tuple[int, ...], torch.Tensor]] = {}
        self._argmax: Callable[[torch.Tensor], torch.Tensor] = _torch_argmax
        if device.type == "cuda":
            from braid.kernels.argmax import argmax_rows

            self._argmax = argmax_rows

    def _counts(self, seqs: list[Sequence[int]]) -> torch.Tensor:
        ids = _padded(seqs, self.vocab_size, self.device)
        counts = torch.zeros(len(seqs), self.vocab_size + 1, device=self.device)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
        return counts[:, : self.vocab_size]

    def _apply_penalties(self, logits: torch.Tensor, reqs: list[SamplingInput]) -> None:
        ps = [r.params for r in reqs]
        dev = self.device
        if any(p.repetition_penalty != 1.0 for p in ps):
            seen = self._counts([list(r.prompt_ids) + list(r.output_ids) for r in reqs]) > 0
            rep = to_device([p.repetition_penalty for p in ps], dev, torch.float32)[:, None]
            penalised = torch.where(logits > 0, logits / rep, logits * rep)
            logits.copy_(torch.where(seen, penalised, logits))
        if any(p.frequency_penalty or p.presence_penalty for p in ps):
            out_counts = self._counts([r.output_ids for r in reqs])
            freq = to_device([p.frequency_penalty for p in ps], dev, torch.float32)[:, None]
            pres = to_device([p.presence_penalty for p in ps], dev, torch.float32)[:, None]
            logits -= freq * out_counts + pres * (out_counts > 0)

    def _apply_bias_and_min_tokens(
        self, logits: torch.Tensor, reqs: list[SamplingInput], ahead: int
    ) -> None:
        rows, cols, vals = [], [], []
        for i, r in enumerate(reqs):
            for tok, bias in (r.params.logit_bias or {}).items():
                if tok >= logits.shape[1]:  # past a draft model's vocabulary
                    continue
                rows.append(i)
                cols.append(tok)
                vals.append(bias)
        if rows:
            logits.index_put_(
                (to_device(rows, self.device), to_device(cols, self.device)),
                to_device(vals, self.device, logits.dtype),
                accumulate=True,
            )
        rows, cols = [], []
        for i, r in enumerate(reqs):
            if len(r.output_ids) + ahead < r.params.min_tokens:
                stops = [t for t in r.stop_ids if t < logits.shape[1]]
                rows.extend([i] * len(stops))
                cols.extend(stops)
        if rows:
            self._ban(logits, rows, cols)

    def _allowed(self, ids: tuple[int, ...], width: int) -> torch.Tensor:
        """`ids` below `width` on the device, made once per list object (a request samples
        every step with its own; looked up by identity, not by hashing the list each step).
        The cache is dropped whole past a bound on the ids it holds."""
        got = self._allowed_cache.get((id(ids), width))
        if got is not None and got[0] is ids:
            return got[1]
        held = sum(len(t) for _, t in self._allowed_cache.values())
        if held + len(ids) > _ALLOWED_CACHE_IDS:
            self._allowed_cache.clear()
        tensor = to_device([t for t in ids if t < width], self.device)
        self._allowed_cache[(id(ids), width)] = (ids, tensor)
        return tensor

    def _apply_token_masks(self, logits: torch.Tensor, reqs: list[SamplingInput]) -> None:
        """Only `allowed_token_ids` stay sampleable, and each bad word's last token is banned
        where the output ends with the tokens before it (a one-token word: always). Ids past
        the logits' width (a draft model's smaller vocabulary) are left out. Nothing here
        waits for the device: a step run ahead queues these edits behind the forward."""
        width = logits.shape[1]
        rows = [i for i, r in enumerate(reqs) if r.params.allowed_token_ids]
        if rows:
            # One scatter for every row: the rows' cached ids end to end, each one's row index
            # repeated as often (output_size: no wait for the device to count them).
            cols = [self._allowed(reqs[i].params.allowed_token_ids, width) for i in rows]
            sizes = [len(c) for c in cols]
            owner = torch.repeat_interleave(
                torch.arange(len(rows), device=self.device),
                to_device(sizes, self.device),
                output_size=sum(sizes),
            )
            keep = torch.zeros(len(rows), width, dtype=torch.bool, device=self.device)
            keep.index_put_((owner, torch.cat(cols)), keep.new_ones(()))
            at = to_device(rows, self.device)
            logits.index_copy_(0, at, logits.index_select(0, at).masked_fill_(~keep, _NEG_INF))
        rows, cols = [], []
        for i, r in enumerate(reqs):
            out = r.output_ids
            for word in r.params.bad_words_token_ids or ():
                n = len(word) - 1
                if word[n] < width and (
                    n == 0 or (len(out) >= n and tuple(out[len(out) - n :]) == word[:n])
                ):
                    rows.append(i)
                    cols.append(word[n])
        if rows:
            self._ban(logits, rows, cols)

    def _ban(self, logits: torch.Tensor, rows: list[int], cols: list[int]) -> None:
        """-inf at (rows[k], cols[k]), without a host wait (a Python scalar assigned through
        device indices makes one)."""
        logits.index_put_(
            (to_device(rows, self.device), to_device(cols, self.device)),
            logits.new_full((), _NEG_INF),
        )

    def sample(
        self,
        logits: torch.Tensor,
        reqs: list[SamplingInput],
        *,
        bitmask: torch.Tensor | None = None,
        bitmask_rows: torch.Tensor | None = None,
        ahead: int = 0,
    ) -> SampleResult:
        """Choose one token per row of `logits` ([B, vocab], float32). `bitmask` ([R, words]
        int32, see `braid.runtime.constrained.bitmask`) bans, in row `bitmask_rows[i]`, the
        tokens whose bit is clear in `bitmask[i]` (grammars); rows without one cost nothing.
        `ahead`: how many tokens each request has sampled beyond its `output_ids` (a step run
        ahead of reading back the previous one); they count toward `min_tokens` and the draw's
        step. Penalties and bad words read `output_ids` itself, so a step run ahead must not
        use them (`SamplingParams.reads_output`)."""
        ps = [r.params for r in reqs]
        want_logprobs = any(p.logprobs is not None for p in ps)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        edits = bitmask is not None or any(
            p.logit_bias
            or p.penalized
            or p.masks_tokens
            or len(r.output_ids) + ahead < p.min_tokens
            for p, r in zip(ps, reqs)
        )
        if edits:
            # The edits below are in place; `logits` may be a CUDA graph's output buffer.
            logits = logits.clone()
        if bitmask is not None:
            assert bitmask_rows is not None, "a bitmask needs its rows"
            apply_token_bitmask(logits, bitmask, bitmask_rows)
        self._apply_token_masks(logits, reqs)
        self._apply_bias_and_min_tokens(logits, reqs, ahead)
        self._apply_penalties(logits, reqs)

        greedy_ids = self._argmax(logits)
        greedy = [p.greedy for p in ps]
        if all(greedy):
            next_ids = greedy_ids
        else:
            next_ids = self._draw(logits, reqs, ps, greedy_ids, greedy, ahead)
        result = SampleResult(next_ids=next_ids)
        if raw_logprobs is not None:
            self._fill_logprobs(result, raw_logprobs, ps)
        return result

    def _draw(self, logits, reqs, ps, greedy_ids, greedy, ahead: int) -> torch.Tensor:
        dev = self.device
        temps = to_device(
            [1.0 if g else max(p.temperature, MIN_TEMPERATURE) for p, g in zip(ps, greedy)],
            dev,
            torch.float32,
        )
        logits = logits / temps[:, None]
        use_top_k = any(p.top_k > 0 for p in ps)
        use_top_p = any(p.top_p < 1.0 for p in ps)
        if use_top_k or use_top_p:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            if use_top_k:
                ks = to_device([p.top_k if p.top_k > 0 else self.vocab_size for p in ps], dev)
                pos = torch.arange(self.vocab_size, device=dev)[None, :]
                sorted_logits.masked_fill_(pos >= ks[:, None], float("-inf"))
            if use_top_p:
                probs = sorted_logits.softmax(dim=-1)
                before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
                top_p = to_device([p.top_p for p in ps], dev, torch.float32)[:, None]
                sorted_logits.masked_fill_(before > top_p, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        if any(p.min_p > 0 for p in ps):
            min_p = to_device([p.min_p for p in ps], dev, torch.float32)[:, None]
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        seeds = to_device([r.seed for r in reqs], dev)
        steps = to_device([len(r.output_ids) + ahead for r in reqs], dev)
        # Exponential noise, > 0 and finite: a token of probability 0 (banned by a grammar or
        # a filter) scores 0 and never beats a token the distribution allows.
        noise = -torch.log(hash_uniform(seeds, steps, self.vocab_size))
        drawn = (probs / noise).argmax(dim=-1)
        return torch.where(to_device(greedy, dev, torch.bool), greedy_ids, drawn)

    def _fill_logprobs(self, result: SampleResult, raw: torch.Tensor, ps) -> None:
        chosen = raw.gather(1, result.next_ids[:, None])
        result.logprobs = chosen[:, 0]
        result.ranks = (raw > chosen).sum(dim=-1) + 1
        k = max(p.logprobs or 0 for p in ps)
        if k:
            top = raw.topk(k, dim=-1)
            result.top_ids, result.top_logprobs = top.indices, top.values
