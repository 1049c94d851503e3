"""Log-probabilities the scheduler reports: of sampled tokens, and of prompt tokens."""

from __future__ import annotations

import torch

from braid.runtime.executor.sampler import SampleResult
from braid.runtime.ipc.to_detokenizer import TokenLogprob
from braid.runtime.scheduler.request import Req


def token_logprobs(result: SampleResult) -> list[TokenLogprob]:
    """One `TokenLogprob` per sampled row, with its top alternatives when asked."""
    ids = result.next_ids.tolist()
    lps = result.logprobs.tolist()
    ranks = result.ranks.tolist()
    tops = (
        list(zip(result.top_ids.tolist(), result.top_logprobs.tolist()))
        if result.top_ids is not None
        else [([], [])] * len(ids)
    )
    return [
        TokenLogprob(t, lp, rk, list(zip(ti, tl)))
        for t, lp, rk, (ti, tl) in zip(ids, lps, ranks, tops)
    ]


def prompt_logprobs(req: Req, rows: torch.Tensor) -> list[TokenLogprob | None]:
    """Log-probabilities of prompt tokens from `max(1, logprob_start_len)` on (earlier
    positions are None); `rows` are the logits of the last `len(rows)` prompt positions (each
    scores the next token)."""
    k = req.params.prompt_logprobs
    first_row = req.prompt_len - rows.shape[0]  # the position of rows[0]
    begin = max(1, req.params.logprob_start_len, first_row + 1)  # first scored position
    lp = torch.log_softmax(rows[begin - 1 - first_row : req.prompt_len - 1 - first_row], -1)
    targets = torch.tensor(req.input_ids[begin:], device=lp.device)
    chosen = lp.gather(1, targets[:, None])
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    top = lp.topk(k, dim=-1) if k else None
    out: list[TokenLogprob | None] = [None] * min(begin, req.prompt_len)  # one per position
    for j, (t, c) in enumerate(zip(req.input_ids[begin:], chosen[:, 0].tolist())):
        alts = list(zip(top.indices[j].tolist(), top.values[j].tolist())) if top else []
        out.append(TokenLogprob(t, c, ranks[j], alts))
    return out
