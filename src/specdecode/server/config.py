"""One server's configuration, every default once: the model, the drafter, the caches, where it
listens and the app's limits.

`specdecode serve` takes its options' defaults from here and builds its app from one; with
Ray, every replica (and every actor of `specdecode batch`) is sent the same config and builds
its own engine from it, so a config holds names and numbers only (it is pickled), never a
loaded model. `create_app` (or `app_from_config`) and `EngineWorker` take it whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from specdecode import precision
from specdecode.cache.engine_caches import CacheOptions
from specdecode.core.checks import DEFAULT_SPECULATIVE_TOKENS, check_k, check_max_model_len
from specdecode.errors import InvalidArgumentError
from specdecode.loading import DEFAULT_TARGET

if TYPE_CHECKING:
    from specdecode.engine import SpeculativeEngine


@dataclass(frozen=True)
class ServerConfig:
    # the engine
    target: str = DEFAULT_TARGET
    draft: str | None = None
    drafter: str = "auto"
    num_speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS  # k, the most tokens drafted per step
    adaptive: bool = True  # k chosen per step from measurements (core/adaptive.py); False: k every step
    shipped_head: bool = True  # drafter auto without draft: the head shipped for the target, if any
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's context length
    quantization: str | None = None
    cache: CacheOptions = field(default_factory=CacheOptions)
    # the server
    model_name: str | None = None  # the name clients ask for (None: target)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = field(default=None, repr=False)  # never printed (logs, errors)
    metrics_without_key: bool = False  # with an api_key, /metrics still needs none
    max_waiting: int = 64  # requests queued beyond the running batch before new ones get 429
    max_batch_size: int = 16  # requests decoded together (continuous batching)
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    # what any client, authenticated or not, can hold (server/limits.py; docs/serving.md, "Limits")
    max_connections: int = 256  # open at once; one more is answered 503 and closed
    max_header_bytes: int = 32 << 10  # a request's headers; more is answered 400 and closed
    read_timeout_s: float = 30.0  # a request not in whole this long after its first byte is closed
    max_request_seconds: float = 600.0  # a request still running this long after it arrived fails (504)
    kv_cache_gb: float | None = None  # the batch's KV caches' budget (app.batch_size_for_budget); None: none
    otel_console: bool = False  # spans to the console too (OTLP export follows the OTEL_* variables)

    def __post_init__(self) -> None:
        """A config holds no value the server would refuse later (the engine's checks included,
        so that a Ray replica never starts on one)."""
        check_k(self.num_speculative_tokens)
        check_max_model_len(self.max_model_len)
        precision.dtype_named(self.dtype)  # unknown names are refused here, not in a replica
        precision.quantization_named(self.quantization, precision.TARGET)
        if not 0 < self.port < 65536:
            raise InvalidArgumentError(f"port must be in [1, 65535], got {self.port}", "port")
        for name in ("max_waiting", "max_batch_size", "max_body_bytes", "max_connections", "max_header_bytes"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name} must be at least 1, got {getattr(self, name)}", name)
        check_api_key(self.api_key)
        for name in ("max_request_seconds", "kv_cache_gb", "read_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise InvalidArgumentError(f"{name} must be positive, got {value}", name)

    @property
    def key_note(self) -> str:
        """What the serving banner says of the key: whether clients need one."""
        return "API key required" if self.api_key is not None else "no API key: any client that reaches it may use it"

    @property
    def served_name(self) -> str:
        """The model name of the API (/v1/models, each request's `model`)."""
        return self.model_name if self.model_name is not None else self.target

    def with_batch_size(self, max_batch_size: int) -> ServerConfig:
        return replace(self, max_batch_size=max_batch_size, max_waiting=max(self.max_waiting, max_batch_size))

    def engine(self) -> SpeculativeEngine:
        from specdecode.engine import DrafterOptions, SpeculativeEngine

        return SpeculativeEngine.from_pretrained(
            self.target,
            draft=self.draft,
            drafter=self.drafter,
            num_speculative_tokens=self.num_speculative_tokens,
            device=self.device,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            cache=self.cache,
            quantization=self.quantization,
            options=DrafterOptions(adaptive=self.adaptive, shipped_head=self.shipped_head),
        )


def check_api_key(api_key: str | None) -> None:
    """A key a client can send: never empty (a deploy script whose variable is unset would
    otherwise open the server to 'Authorization: Bearer ' with nothing after it), and without
    spaces around it or characters an HTTP header cannot carry."""
    if api_key is None:
        return
    if not api_key.strip():
        raise InvalidArgumentError(
            "api_key must not be empty; set a key (SPECDECODE_API_KEY), or leave --api-key out to serve without one",
            "api_key",
        )
    if api_key != api_key.strip() or not api_key.isascii() or not api_key.isprintable():
        raise InvalidArgumentError(
            "api_key must be printable ASCII without spaces around it, as an Authorization header carries it",
            "api_key",
        )
