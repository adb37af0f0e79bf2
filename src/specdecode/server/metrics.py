"""Prometheus metrics of the server, named in vLLM's style (`specdecode:...`), so dashboards
made for vLLM need few changes.

Each app gets its own registry: several apps in one process (as in the tests) must not
share counts or collide on names.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
_PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests_running = Gauge("specdecode:num_requests_running", "Requests being generated now.", registry=r)
        self.requests_waiting = Gauge("specdecode:num_requests_waiting", "Requests queued for the engine.", registry=r)
        self.prompt_tokens = Counter("specdecode:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("specdecode:generation_tokens", "Tokens generated.", registry=r)
        self.draft_tokens = Counter(
            "specdecode:spec_decode_num_draft_tokens", "Tokens the drafter proposed.", registry=r
        )
        self.accepted_tokens = Counter(
            "specdecode:spec_decode_num_accepted_tokens", "Draft tokens the target accepted.", registry=r
        )
        self.target_forwards = Counter(
            "specdecode:spec_decode_num_target_forwards", "Verification steps (target forwards).", registry=r
        )
        self.accepted_per_position = Counter(
            "specdecode:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position in the draft (0 = first).",
            ["position"],
            registry=r,
        )
        self.acceptance_rate = Gauge(
            "specdecode:spec_decode_draft_acceptance_rate", "Accepted / drafted tokens so far.", registry=r
        )
        self.acceptance_rate.set_function(
            lambda: _ratio(self.accepted_tokens._value.get(), self.draft_tokens._value.get())
        )
        self.batch_size = Histogram(
            "specdecode:batch_size", "Sequences advanced by one engine step.", buckets=_BATCH_BUCKETS, registry=r
        )
        self.step_retries = Counter(
            "specdecode:engine_step_retries", "Engine steps that failed and were tried again.", registry=r
        )
        self.worker_restarts = Counter(
            "specdecode:engine_worker_restarts", "Times the engine thread died and was restarted.", registry=r
        )
        self.requests_finished = Counter(
            "specdecode:request_success",
            "Requests finished, by finish reason (abort: the client went away).",
            ["finished_reason"],
            registry=r,
        )
        self.errors = Counter(
            "specdecode:request_errors", "Requests answered with an error, by kind.", ["kind"], registry=r
        )
        self.time_to_first_token = Histogram(
            "specdecode:time_to_first_token_seconds",
            "Arrival to first token available to the client (queue wait included).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            "specdecode:time_per_output_token_seconds",
            "Seconds per generated token after the first.",
            buckets=_PER_TOKEN_BUCKETS,
            registry=r,
        )
        self.response_cache = Counter(
            "specdecode:response_cache_lookups",
            "Deterministic requests looked up in the response cache, by result (hit or miss).",
            ["result"],
            registry=r,
        )
        self.drafted_by_source = Counter(
            "specdecode:spec_decode_num_draft_tokens_by_source",
            "Tokens proposed, by the drafter that proposed them (auto's candidates apart).",
            ["source"],
            registry=r,
        )
        self.accepted_by_source = Counter(
            "specdecode:spec_decode_num_accepted_tokens_by_source",
            "Draft tokens accepted, by the drafter that proposed them.",
            ["source"],
            registry=r,
        )
        self.cache_backend_errors = Gauge(
            "specdecode:cache_backend_errors",
            "Cache backend (Redis) calls that failed and were served in process.",
            registry=r,
        )
        self.draft_store_tokens = Gauge(
            "specdecode:draft_store_tokens", "Tokens of earlier requests indexed by the draft store.", registry=r
        )
        self.e2e_latency = Histogram(
            "specdecode:e2e_request_latency_seconds",
            "Arrival to the finished result (queue wait included).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0
