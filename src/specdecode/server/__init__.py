"""An OpenAI-compatible HTTP server in front of one SpeculativeEngine (`specdecode serve`).

`create_app` and `run_server` are imported on first use, so that reading a ServerConfig (as
the CLI does for its defaults) does not load the web stack and the engine.
"""

__all__ = ["create_app", "run_server"]


def __getattr__(name: str):
    if name in __all__:
        from specdecode.server import app

        return getattr(app, name)
    raise AttributeError(f"module 'specdecode.server' has no attribute '{name}'")
