"""An OpenAI-compatible HTTP server in front of one SpeculativeEngine (`specdecode serve`)."""

from specdecode.server.app import create_app, run_server

__all__ = ["create_app", "run_server"]
