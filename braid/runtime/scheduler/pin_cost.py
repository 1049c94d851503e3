"""Whether pinning a paused program's KV pays, on this device and this pool.

A pin keeps a program's context (c tokens) in the pool through its tool call (a pause of p
seconds), where nothing else can use it; not pinning it risks computing it again when the
program comes back. Both costs are device time:
- holding: the pool runs with c of its C tokens taken for p seconds, which costs about
  c / C x p of a full pool's work (decode and admission scale with the tokens running);
- recomputing: c / r seconds, at the device's measured prefill rate r.

So a pin pays when c / r > c x p / C, that is when C > p x r: when the pool holds more tokens
than the device prefills during the pause. The context's length drops out. On the H200 with an
8B model (r about 20-40 thousand tokens/s) and the agent benchmark's pool of 4096 tokens,
pauses of 50-500 ms make pins cost more than they save (256 programs: pins turned the program
policy's 1.52x lpm into 1.25x, and 0.91x into 0.60x on programs alike in length); on a CPU
(r about 1-3 thousand) they pay; with a production pool (C near a million) they pay
everywhere. (Continuum pins for a TTL from tool-call times alone; this adds the device.)

The holding cost is paid only while requests wait for room, so the scheduler asks the rule
only then (`Scheduler._pin_pays`): with no queue a pin keeps nothing out, and gives way to the
queue's head if one forms. The rule needs a rate and a pause: until the scheduler has timed a
prefill and seen a pause (the program's own, else any program's), a pin is made. A client
that asked for a TTL (`session_ttl_s`) always gets its pin.

The rate is measured over whole extend steps whose samples are read back (a chunk that
samples nothing is only launched, on CUDA, and is not timed): each step's fixed cost (the
launch, the host's work on the step, a first call's kernel compiles) counts, so it is lower
than the rate at which a long context would be recomputed, most of all when short extends
dominate (pinned contexts make them short). That errs towards pinning. On the H200 with a
16384-token pool, where the rule pinned, pins still cost the program policy a little (p50
5.04 against 4.60 s, below the load point: docs/benchmarks.md).
"""

from __future__ import annotations

# Weight of the history in a decayed ratio, per observation: the last few dozen count.
DECAY = 0.95


class DecayedRatio:
    """Sum of the observed numerators over sum of their denominators, each sum decayed by
    DECAY an observation: a mean of recent values (denominator 1 each), or a rate (tokens over
    seconds, the longer observations weighing more). None before any observation."""

    def __init__(self) -> None:
        self._num = 0.0
        self._den = 0.0

    def add(self, num: float, den: float = 1.0) -> None:
        self._num = self._num * DECAY + num
        self._den = self._den * DECAY + den

    @property
    def value(self) -> float | None:
        return self._num / self._den if self._den > 0 else None


class PinCost:
    """The measured prefill rate and the rule above for a pool of `capacity_tokens`."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self._rate = DecayedRatio()  # tokens over seconds of the timed prefill steps
        self.declined = 0  # finished session requests whose KV was not pinned: it would not pay

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill step computed `tokens` tokens in `seconds` of wall time."""
        if tokens > 0 and seconds > 0:
            self._rate.add(tokens, seconds)

    @property
    def prefill_rate(self) -> float | None:
        """Tokens per second over the recent prefill steps (the larger weigh more); None
        before the first."""
        return self._rate.value

    def pays(self, pause_s: float | None) -> bool:
        """Whether a pin through an expected pause of `pause_s` seconds pays (True while the
        rate or the pause is unknown); a pin that does not is counted in `declined`."""
        rate = self.prefill_rate
        if rate is None or pause_s is None:
            return True
        if self.capacity_tokens > pause_s * rate:
            return True
        self.declined += 1
        return False
