"""Server-side counters and latency histograms, and the scheduler's figures (programs among
them), rendered as Prometheus text."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from braid.runtime.ipc.to_tokenizer import ProgramInfo

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Programs holding pins, by the tokens each holds pinned (`le`: at most that many).
PINNED_TOKEN_BUCKETS = (256, 1024, 4096, 16384, 65536, 262144)
# Programs named in the per-program series: the first of the scheduler's list.
TOP_PROGRAMS = 5


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        acc = 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            lines.append(f'{name}_bucket{{le="{b}"}} {acc}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        lines += [f"{name}_sum {self.total}", f"{name}_count {self.n}"]
        return lines


def _label(value: str) -> str:
    """A Prometheus label value, escaped (backslash, double quote, line feed)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_programs(programs: list[ProgramInfo]) -> list[str]:
    """Per-program figures with bounded label cardinality. A program's id is the client's (a
    session id), so one series per program would grow without bound as programs come and go.
    Instead:

    - `braid_programs_by_pinned_tokens{le=...}`: how many programs hold at most that many
      tokens pinned, over every program holding pins (the scheduler lists them all). A
      snapshot histogram: cumulative gauges, one fixed series per bucket, which
      `histogram_quantile` reads. The totals are `braid_pinned_tokens`,
      `braid_pinned_programs` and `braid_programs_in_flight`.
    - `braid_program_pinned_tokens`, `braid_program_service_tokens` (attained service) and
      `braid_program_calls_served`, labelled by `program`, for the TOP_PROGRAMS programs the
      scheduler lists first (the most pinned tokens, then the most service): at most
      TOP_PROGRAMS series each at any time, naming the programs an operator looks at first.

    Every listed program's figures are in /get_server_info's `programs`."""
    name = "braid_programs_by_pinned_tokens"
    lines = [
        f"# HELP {name} Programs holding session pins, by tokens pinned (at most le).",
        f"# TYPE {name} gauge",
    ]
    pinned = [p.pinned_tokens for p in programs if p.pinned_tokens > 0]
    for b in PINNED_TOKEN_BUCKETS:
        lines.append(f'{name}{{le="{b}"}} {sum(1 for t in pinned if t <= b)}')
    lines.append(f'{name}{{le="+Inf"}} {len(pinned)}')
    top = programs[:TOP_PROGRAMS]
    for metric, attr, text in (
        ("braid_program_pinned_tokens", "pinned_tokens", "KV tokens pinned for the program."),
        ("braid_program_service_tokens", "service", "Tokens computed for the program."),
        ("braid_program_calls_served", "calls_served", "The program's calls served."),
    ):
        lines += [f"# HELP {metric} {text} (top {TOP_PROGRAMS})", f"# TYPE {metric} gauge"]
        lines += [f'{metric}{{program="{_label(p.id)}"}} {getattr(p, attr)}' for p in top]
    return lines


@dataclass
class ServerMetrics:
    requests: int = 0
    requests_failed: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))

    def render(self, scheduler: dict[str, float], programs: list[ProgramInfo]) -> str:
        """Prometheus text: the server's counters, the scheduler's `stats` and its `programs`
        (`render_programs`), the latency histograms."""
        rows = [
            ("braid_requests_total", "counter", "Requests received.", self.requests),
            (
                "braid_requests_failed_total",
                "counter",
                "Requests that failed.",
                self.requests_failed,
            ),
            (
                "braid_prompt_tokens_total",
                "counter",
                "Prompt tokens processed.",
                self.prompt_tokens,
            ),
            (
                "braid_generation_tokens_total",
                "counter",
                "Tokens generated.",
                self.generation_tokens,
            ),
        ]
        gauges = [  # (metric, scheduler stat, help)
            ("braid_num_running_requests", "running_requests", "Requests running."),
            ("braid_num_queued_requests", "queued_requests", "Requests waiting."),
            ("braid_cache_hit_rate", "cache_hit_rate", "Cached prompt tokens / prompt tokens."),
            ("braid_kv_usage", "kv_usage", "Fraction of KV slots held by running requests."),
            ("braid_kv_free_tokens", "kv_free_tokens", "Free KV slots."),
            ("braid_kv_cached_tokens", "kv_cached_tokens", "KV slots held by the prefix cache."),
            (
                "braid_spec_accept_length",
                "spec_accept_length",
                "Speculative decoding: mean tokens a request gains per decode step.",
            ),
            ("braid_programs_in_flight", "programs_in_flight", "Programs with a request running."),
            ("braid_programs_known", "programs_known", "Programs the scheduler keeps track of."),
            ("braid_pinned_sessions", "pinned_sessions", "Program sessions holding a KV pin."),
            ("braid_pinned_programs", "pinned_programs", "Programs holding a KV pin."),
            ("braid_pinned_tokens", "pinned_tokens", "KV slots pinned for program sessions."),
        ]
        rows += [(name, "gauge", text, scheduler.get(stat, 0)) for name, stat, text in gauges]
        counters = [  # (metric, scheduler stat, help): counters kept by the scheduler
            ("braid_programs_ended_total", "programs_ended", "Programs ended or forgotten."),
            ("braid_pins_expired_total", "pins_expired", "Session pins released by their TTL."),
            (
                "braid_pins_released_for_room_total",
                "pins_released_for_room",
                "Session pins released early to make room for running requests (or for a "
                "waiting one when nothing runs).",
            ),
            (
                "braid_pins_declined_total",
                "pins_declined",
                "Finished session requests whose KV was not pinned because holding it "
                "through the program's expected pause would cost more than computing it "
                "again (the pool holds fewer tokens than the device prefills in that pause).",
            ),
            (
                "braid_program_tokens_recomputed_total",
                "program_tokens_recomputed",
                "Tokens computed again for programs, not counted as their service: KV the "
                "prefix cache evicted or a retraction dropped, and KV a request computed and "
                "gave back (the overlap schedule's run-ahead row of a request that jumped "
                "forward, rejected jump-forward tokens). Across a program's requests (a prompt "
                "repeating an earlier sequence) only under --schedule-policy program.",
            ),
            (
                "braid_spec_draft_tokens_total",
                "spec_draft_tokens",
                "Speculative decoding: draft tokens verified.",
            ),
            (
                "braid_spec_accepted_tokens_total",
                "spec_accepted_tokens",
                "Speculative decoding: draft tokens kept.",
            ),
        ]
        rows += [(name, "counter", text, scheduler.get(stat, 0)) for name, stat, text in counters]
        lines = []
        for name, kind, text, value in rows:
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {value}"]
        lines += render_programs(programs)
        lines += self.ttft.render("braid_time_to_first_token_seconds", "Time to first token.")
        lines += self.itl.render("braid_inter_token_latency_seconds", "Time between tokens.")
        return "\n".join(lines) + "\n"
