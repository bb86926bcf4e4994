"""The engine's own errors (vLLM: `vllm/v1/engine/exceptions.py`)."""


class EngineDeadError(RuntimeError):
    """The engine core died (its step raised, or its process was killed) or was
    shut down: every request in flight ends with this error, and every later
    call raises it at once instead of waiting for a core that will never answer."""
