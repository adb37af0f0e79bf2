"""What builds one server: the model, the drafter, the caches and the app's limits, as a value.

`specdecode serve` builds its app from one in this process; with Ray, every replica (and every
actor of `specdecode batch`) is sent the same spec and builds its own engine from it, so a spec
holds names and numbers only (it is pickled), never a loaded model.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

from fastapi import FastAPI

from specdecode.engine import CacheOptions, DrafterOptions, SpeculativeEngine
from specdecode.server.app import create_app
from specdecode.server.faults import StepHook


@dataclass(frozen=True)
class ServerSpec:
    target: str
    draft: str | None = None
    drafter: str = "auto"
    num_speculative_tokens: int = 4
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None
    quantization: str | None = None
    cache: CacheOptions = field(default_factory=CacheOptions)
    api_key: str | None = field(default=None, repr=False)  # never printed (logs, errors)
    max_waiting: int = 64
    max_batch_size: int = 16
    max_request_seconds: float = 600.0
    kv_cache_gb: float | None = None
    otel_console: bool = False  # spans to the console too (OTLP export follows the OTEL_* variables)
    metrics_without_key: bool = False  # with an api_key, /metrics still needs none
    adaptive: bool = True  # k chosen per step from measurements (core/adaptive.py); False: k every step

    @property
    def model_name(self) -> str:
        return self.target

    def with_batch_size(self, max_batch_size: int) -> ServerSpec:
        return replace(self, max_batch_size=max_batch_size, max_waiting=max(self.max_waiting, max_batch_size))

    def engine(self) -> SpeculativeEngine:
        return SpeculativeEngine.from_pretrained(
            self.target,
            self.draft,
            self.drafter,
            self.num_speculative_tokens,
            self.device,
            self.dtype,
            max_model_len=self.max_model_len,
            cache=self.cache,
            quantization=self.quantization,
            options=DrafterOptions(adaptive=self.adaptive),
        )

    def app(
        self,
        engine: SpeculativeEngine | None = None,
        start_worker: bool = True,
        faults: StepHook | None = None,
        metrics_text: Callable[[], Awaitable[bytes]] | None = None,
    ) -> FastAPI:
        """The app over `engine` (default: one loaded here from this spec)."""
        return create_app(
            engine if engine is not None else self.engine(),
            self.model_name,
            self.api_key,
            self.max_waiting,
            max_batch_size=self.max_batch_size,
            max_request_seconds=self.max_request_seconds,
            faults=faults,
            start_worker=start_worker,
            kv_cache_gb=self.kv_cache_gb,
            tracing=tracing(self.otel_console),
            metrics_text=metrics_text,
            metrics_without_key=self.metrics_without_key,
        )


def tracing(console: bool):
    """OpenTelemetry tracing as the OTEL_* variables ask, and to the console when asked; None
    (off: the SDK is not even imported) when neither."""
    import os

    otel = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if not console and not any(os.environ.get(name) for name in otel):
        return None
    from specdecode.server.tracing import from_environment

    return from_environment(console)
