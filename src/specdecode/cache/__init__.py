"""What the engine remembers across requests: a draft store and an exact response cache, in
process or shared through Redis. Neither can change an output: drafts are verified like any
other, and a cached response is served only where outputs do not depend on the batch."""

from specdecode.cache.backends import Backend, InProcessBackend, RedisBackend, open_backend
from specdecode.cache.draft_store import DraftStore
from specdecode.cache.response_cache import ResponseCache, model_fingerprint

__all__ = [
    "Backend",
    "DraftStore",
    "InProcessBackend",
    "RedisBackend",
    "ResponseCache",
    "model_fingerprint",
    "open_backend",
]
