"""The executor: runs a planned step on the device, the model forward and the sampling of its
rows. The scheduler plans batches and consumes the samples; this is the only part of the step
that touches the model (the seam a verify step and one-executor-per-rank plug into).

A decode is launched without waiting: the forward and its sampling are queued and the samples'
copy to the host is started, so the host can plan the next step (or queue it, fed by these
samples on the device) while the device computes. A step's grammar masks are asked for
(`masks`) once its forward is queued, so building them on the host overlaps the forward. A
decode queued ahead with constrained rows is launched in two halves (`launch_forward`, then
`launch_sample` once the previous step's tokens have advanced the grammars).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from braid.runtime.executor.model_runner import ModelRunner
from braid.runtime.executor.sampler import Sampler, SampleResult, SamplingInput
from braid.runtime.forward_batch import ForwardBatch

# A step's grammar masks (the sampler's bitmask arguments), built when asked.
Masks = Callable[[], dict[str, torch.Tensor]]


class Executor:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.device = runner.device
        self.vocab_size = runner.model_config.vocab_size
        self.sampler = Sampler(self.vocab_size, self.device)

    def extend(
        self,
        batch: ForwardBatch,
        last_rows: list[int],
        inputs: list[SamplingInput],
        masks: Masks,
    ) -> tuple[torch.Tensor, SampleResult | None]:
        """Run a prefill forward and sample a token at `last_rows` for `inputs` (none if there
        are none: chunks that do not finish a prompt); returns the logits too, which jump
        verification and prompt logprobs read."""
        logits = self.runner.forward(batch)
        if not inputs:
            return logits, None
        last = logits[last_rows] if len(last_rows) != logits.shape[0] else logits
        return logits, self.sampler.sample(last, inputs, **masks())

    def launch_decode(
        self,
        batch: ForwardBatch,
        inputs: list[SamplingInput],
        masks: Masks,
        ahead: int = 0,
    ) -> SampleResult:
        """Queue a decode forward and its sampling, and start copying the samples to the host;
        nothing is waited for. `ahead`: tokens each request has sampled that its inputs do not
        show yet (a step queued before the previous one is read back)."""
        return self.launch_sample(self.launch_forward(batch), inputs, masks, ahead)

    def launch_forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Queue a decode forward alone; its logits are sampled later (`launch_sample`), once
        the host knows what the step's grammar masks must be."""
        return self.runner.forward(batch)

    def launch_sample(
        self, logits: torch.Tensor, inputs: list[SamplingInput], masks: Masks, ahead: int = 0
    ) -> SampleResult:
        """Queue the sampling of a decode forward's `logits` and start copying the samples to
        the host."""
        result = self.sampler.sample(logits, inputs, **masks(), ahead=ahead)
        self.runner.share_samples(result.next_ids)
        result.copy_to_host_async()
        return result

    def sample(
        self, logits: torch.Tensor, inputs: list[SamplingInput], **mask: torch.Tensor
    ) -> SampleResult:
        """Sample one token per row of `logits` (rows already computed)."""
        return self.sampler.sample(logits, inputs, **mask)
