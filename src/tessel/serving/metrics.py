"""The server's Prometheus metrics: what the engine reports (its `Listener`) counted on a
registry of its own, rendered as Prometheus text for `GET /metrics`.

Names are `tessel_*`, each the twin of a vLLM metric (`vllm:num_requests_running`,
`vllm:time_to_first_token_seconds`, ...) or TGI's, so dashboards port by renaming.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# the reasons a request is refused before it runs (`requests_rejected_total{reason}`)
REJECTED = ("queue_full", "too_long", "bad_request", "timeout")

# seconds; vLLM's buckets for the same histograms, from a CPU's slow steps to a long request
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_GAP = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_LONG = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)

# the engine's running totals (its `loop` stats) and the counter each one feeds
_TOTALS = {
    "prefills": "prefill_calls",
    "decode_steps": "decode_steps",
    "compactions": "compactions",
}


class Metrics:
    """The engine's `Listener`, counting on its own `CollectorRegistry` (two servers in one
    process, as in tests, never share a count). Thread-safe: the engine reports from its
    reader thread and from the event loop."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests_running = Gauge(
            "tessel_requests_running", "Requests holding a slot", registry=r
        )
        self.requests_waiting = Gauge(
            "tessel_requests_waiting", "Requests queued for a slot", registry=r
        )
        self.slots_used = Gauge("tessel_slots_used", "Cache rows a request owns", registry=r)
        self.slots_total = Gauge("tessel_slots_total", "Cache rows of the package", registry=r)
        self.prefill_calls = Counter(
            "tessel_prefill_calls", "Prefill gear calls (one per admission)", registry=r
        )
        self.decode_steps = Counter(
            "tessel_decode_steps", "Decode steps run (each over every slot)", registry=r
        )
        self.compactions = Counter(
            "tessel_compactions", "Cache shifts that made room at the write pointer", registry=r
        )
        self.time_to_first_token = Histogram(
            "tessel_time_to_first_token_seconds",
            "From a request's arrival to its first token",
            buckets=_TTFT,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "tessel_inter_token_latency_seconds",
            "Between a request's successive tokens",
            buckets=_GAP,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            "tessel_e2e_request_latency_seconds",
            "From a request's arrival to its last token",
            buckets=_LONG,
            registry=r,
        )
        self.request_queue_time = Histogram(
            "tessel_request_queue_time_seconds",
            "From a request's arrival to its admission into a slot",
            buckets=_LONG,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "tessel_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter(
            "tessel_generation_tokens", "Tokens made for finished requests", registry=r
        )
        self.request_success = Counter(
            "tessel_request_success",
            "Requests finished, by why (stop: a stop token or string; length: max_tokens)",
            ["finished_reason"],
            registry=r,
        )
        self.requests_rejected = Counter(
            "tessel_requests_rejected",
            "Requests refused before they ran, by why",
            ["reason"],
            registry=r,
        )
        self.requests_aborted = Counter(
            "tessel_requests_aborted", "Requests whose client left before their end", registry=r
        )
        for reason in ("stop", "length"):
            self.request_success.labels(finished_reason=reason)
        for reason in REJECTED:
            self.requests_rejected.labels(reason=reason)
        self._totals: dict[str, int] = {}
        self._lock = threading.Lock()

    # -- the engine's Listener ------------------------------------------------------------

    def rejected(self, reason: str) -> None:
        self.requests_rejected.labels(reason=reason).inc()

    def admitted(self, queue_seconds: float) -> None:
        self.request_queue_time.observe(queue_seconds)

    def first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def token_gap(self, seconds: float) -> None:
        self.inter_token_latency.observe(seconds)

    def finished(
        self, reason: str, seconds: float, prompt_tokens: int, generated_tokens: int
    ) -> None:
        self.request_success.labels(finished_reason=reason).inc()
        self.e2e_request_latency.observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated_tokens)

    def aborted(self) -> None:
        self.requests_aborted.inc()

    def loop(self, stats: dict[str, int]) -> None:
        """Rank 0's counts after a step: gauges set, running totals added as their growth."""
        self.requests_running.set(stats.get("running", 0))
        self.requests_waiting.set(stats.get("waiting", 0))
        self.slots_used.set(stats.get("slots_used", 0))
        if "slots_total" in stats:
            self.slots_total.set(stats["slots_total"])
        with self._lock:
            for key, name in _TOTALS.items():
                if key not in stats:
                    continue
                grown = stats[key] - self._totals.get(key, 0)
                self._totals[key] = stats[key]
                if grown > 0:
                    getattr(self, name).inc(grown)

    # -- the HTTP layer's own -------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text of every metric, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
