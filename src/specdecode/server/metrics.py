"""Prometheus metrics of the server, named in vLLM's style (`specdecode:...`), so dashboards
made for vLLM need few changes, and the OpenTelemetry GenAI semantic conventions' server
histograms (`gen_ai_server_*`, `gen_ai_client_token_usage`), named as OpenTelemetry's
Prometheus exporter names them, so GenAI dashboards work too.

Each app gets its own registry: several apps in one process (as in the tests) must not
share counts or collide on names. A quantity that both families measure (time to first
token, time per output token) is observed once, by one method, into both.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specdecode.core.adaptive import MAX_SPECULATIVE_TOKENS
from specdecode.core.stats import GenerationStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
_PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_DRAFT_LENGTH_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16)
_TREE_SIZE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)  # the tree policy's ladder (core/adaptive.py)
# the bucket boundaries the GenAI semantic conventions advise for each histogram
_GEN_AI_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_GEN_AI_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_GEN_AI_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
_GEN_AI_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
_GEN_AI = ["gen_ai_operation_name", "gen_ai_request_model"]  # gen_ai.operation.name, gen_ai.request.model


class ServerMetrics:
    def __init__(self, model_name: str = "specdecode") -> None:
        self.model_name = model_name  # gen_ai_request_model of the GenAI histograms
        self.positions = MAX_SPECULATIVE_TOKENS  # draft positions with a series of their own (expect)
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests_running = Gauge("specdecode:num_requests_running", "Requests being generated now.", registry=r)
        self.requests_waiting = Gauge("specdecode:num_requests_waiting", "Requests queued for the engine.", registry=r)
        self.prompt_tokens = Counter("specdecode:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.prefix_cache_hits = Counter(
            "specdecode:prefix_cache_hits",
            "Prompt tokens of finished requests found in the KV cache a slot kept (prefix reuse), not run again.",
            registry=r,
        )
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
            "Draft tokens accepted, by their position in the draft (0 = first; a tree: its accepted path by depth).",
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
        self.drafted_per_position = Counter(
            "specdecode:spec_decode_num_draft_tokens_per_pos",
            "Draft tokens proposed, by their position in the draft (0 = first; a tree's nodes by depth): the denominator of acceptance by position.",
            ["position"],
            registry=r,
        )
        self.draft_length = Histogram(
            "specdecode:spec_decode_draft_length",
            "Tokens drafted per engine step of a sequence: the k the policy chose (0: no speculation that step).",
            buckets=_DRAFT_LENGTH_BUCKETS,
            registry=r,
        )
        # trees (a tree step verifies several candidates per position; its tokens per forward
        # are 1 + its accepted depth): mean accepted depth = accepted depth / tree steps
        self.tree_steps = Counter(
            "specdecode:spec_decode_num_tree_steps",
            "Verification steps that verified a draft tree (not a chain).",
            registry=r,
        )
        self.tree_nodes = Counter(
            "specdecode:spec_decode_num_tree_nodes",
            "Draft nodes of the trees verified (every candidate, accepted or not).",
            registry=r,
        )
        self.tree_accepted_depth = Counter(
            "specdecode:spec_decode_tree_accepted_depth",
            "Accepted depths of the tree steps, summed: the tree nodes the target accepted (its accepted paths).",
            registry=r,
        )
        self.tree_size = Histogram(
            "specdecode:spec_decode_tree_size",
            "Nodes per tree step: the tree size the policy chose (what the drafter proposed).",
            buckets=_TREE_SIZE_BUCKETS,
            registry=r,
        )
        # the estimated speedup over target-only decoding: the ratio of these two rates
        self.decode_step_seconds = Counter(
            "specdecode:spec_decode_step_seconds",
            "Seconds of decoding steps (drafting, target forward, acceptance) whose forward size "
            "has a measured one-token-per-sequence cost; steps with a prefill in them are left out.",
            registry=r,
        )
        self.target_only_seconds = Counter(
            "specdecode:spec_decode_target_only_seconds",
            "Estimated seconds target-only decoding would spend on the tokens of the same steps: each "
            "token at 1/batch of the measured seconds of a forward of one token per sequence of that batch.",
            registry=r,
        )
        # the GenAI semantic conventions' server metrics (gen_ai.server.*) and token usage
        self.gen_ai_time_to_first_token = Histogram(
            "gen_ai_server_time_to_first_token_seconds",
            "gen_ai.server.time_to_first_token: arrival to the first token (queue wait included).",
            _GEN_AI,
            buckets=_GEN_AI_TTFT_BUCKETS,
            registry=r,
        )
        self.gen_ai_time_per_output_token = Histogram(
            "gen_ai_server_time_per_output_token_seconds",
            "gen_ai.server.time_per_output_token: seconds per generated token after the first.",
            _GEN_AI,
            buckets=_GEN_AI_TPOT_BUCKETS,
            registry=r,
        )
        self.gen_ai_request_duration = Histogram(
            "gen_ai_server_request_duration_seconds",
            "gen_ai.server.request.duration: arrival to the end of every request the engine took, "
            "error_type set when it did not finish (the exception's class, or abort: the client left).",
            _GEN_AI + ["error_type"],
            buckets=_GEN_AI_DURATION_BUCKETS,
            registry=r,
        )
        self.gen_ai_token_usage = Histogram(
            "gen_ai_client_token_usage",
            "gen_ai.client.token.usage (the conventions' only token histogram): tokens per finished request, "
            "by gen_ai_token_type (input: the prompt; output: generated).",
            _GEN_AI + ["gen_ai_token_type"],
            buckets=_GEN_AI_TOKEN_BUCKETS,
            registry=r,
        )

        # every label value known up front exists from the first scrape, at 0: a series that
        # first appears already counted would hide its first increase from rate()
        for operation in ("chat", "text_completion"):
            for histogram in (self.gen_ai_time_to_first_token, self.gen_ai_time_per_output_token):
                histogram.labels(operation, model_name)
            self.gen_ai_request_duration.labels(operation, model_name, "")
            for token_type in ("input", "output"):
                self.gen_ai_token_usage.labels(operation, model_name, token_type)
        for reason in ("stop", "length", "abort"):
            self.requests_finished.labels(reason)
        for result in ("hit", "miss"):
            self.response_cache.labels(result)

    def expect(self, k_max: int, drafters: list[str]) -> None:
        """Create the series of the draft positions and drafters the engine will use (at 0).
        The engine's k bounds every request's, so these are all the position series there are."""
        self.positions = max(1, min(k_max, MAX_SPECULATIVE_TOKENS))
        for position in range(k_max):
            self.drafted_per_position.labels(str(position))
            self.accepted_per_position.labels(str(position))
        for name in drafters:
            self.drafted_by_source.labels(name)
            self.accepted_by_source.labels(name)

    def observe_time_to_first_token(self, operation: str, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)
        self.gen_ai_time_to_first_token.labels(operation, self.model_name).observe(seconds)

    def observe_time_per_output_token(self, operation: str, seconds: float) -> None:
        self.time_per_output_token.observe(seconds)
        self.gen_ai_time_per_output_token.labels(operation, self.model_name).observe(seconds)

    def observe_request_end(self, operation: str, seconds: float, error_type: str = "") -> None:
        """Once per request the engine took, whatever its outcome ("": finished)."""
        self.gen_ai_request_duration.labels(operation, self.model_name, error_type).observe(seconds)

    def observe_decode_step(self, seconds: float, tokens: int, batch: int, one_token_forward: float | None) -> None:
        """A decoding step of `batch` sequences that emitted `tokens` in `seconds`, beside what
        target-only decoding would spend on them: tokens / batch forwards of one token per
        sequence, at one_token_forward seconds each (the engine's measured cost of a forward of
        `batch` tokens; None: not measured yet, and the step counts in neither sum)."""
        if one_token_forward is None:
            return
        self.decode_step_seconds.inc(seconds)
        self.target_only_seconds.inc(tokens / batch * one_token_forward)

    def observe_finished(self, operation: str, stats: GenerationStats, prompt_tokens: int, output_tokens: int) -> None:
        """A finished request's tokens and what its steps drafted."""
        self.gen_ai_token_usage.labels(operation, self.model_name, "input").observe(prompt_tokens)
        self.gen_ai_token_usage.labels(operation, self.model_name, "output").observe(output_tokens)
        for position, drafted in enumerate(stats.drafted_per_position):
            if drafted:
                self.drafted_per_position.labels(self._position(position)).inc(drafted)
        for position, accepted in enumerate(stats.accepted_per_position):
            if accepted:
                self.accepted_per_position.labels(self._position(position)).inc(accepted)
        for k, steps in stats.drafted_histogram.items():
            for _ in range(steps):  # one observation per step (a few dozen per request)
                self.draft_length.observe(k)
        self.tree_steps.inc(stats.tree_steps)
        self.tree_nodes.inc(stats.tree_nodes)
        self.tree_accepted_depth.inc(stats.tree_accepted_depth)
        for size, steps in stats.tree_histogram.items():
            for _ in range(steps):
                self.tree_size.observe(size)

    def _position(self, position: int) -> str:
        """A draft position's label. A request's k is at most the engine's, so the last one is
        never passed; if it were, the count would join the last series rather than open new
        ones: the series a request can create stay bounded."""
        return str(min(position, self.positions - 1))


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0
