"""An OpenAI-compatible HTTP server in front of one SpeculativeEngine (`specdecode serve`)."""

from specdecode.server.app import create_app

__all__ = ["create_app"]
