"""The exception hierarchy of jengine. Servers map these to HTTP/gRPC statuses in one table (server/errors.py)."""

from __future__ import annotations


class JengineError(Exception):
    """Base of every error jengine raises on purpose."""


class InvalidRequestError(JengineError, ValueError):
    """The request is malformed or asks for something impossible (HTTP 400, gRPC INVALID_ARGUMENT)."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ContextLengthExceededError(InvalidRequestError):
    """Prompt plus requested tokens do not fit the model's context."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message, param=param, code="context_length_exceeded")


class RequestTooLargeError(InvalidRequestError):
    """A body or header block over the server's limit (HTTP 413/431, gRPC RESOURCE_EXHAUSTED)."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message, param=param, code="request_too_large")


class AuthenticationError(JengineError):
    """A missing or wrong API key (HTTP 401, gRPC UNAUTHENTICATED)."""


class NotFoundError(JengineError, LookupError):
    """An unknown model, adapter, route or request id (HTTP 404, gRPC NOT_FOUND)."""

    def __init__(self, message: str, *, code: str = "model_not_found") -> None:
        super().__init__(message)
        self.code = code


class CapacityError(JengineError):
    """The engine is full and refuses more work now (HTTP 429, gRPC RESOURCE_EXHAUSTED)."""


class ServiceUnavailableError(JengineError):
    """Not serving now: draining for shutdown, not ready, or dead (HTTP 503, gRPC UNAVAILABLE)."""


class EngineDeadError(ServiceUnavailableError, RuntimeError):
    """The engine loop has stopped; nothing more can be served (HTTP 503, gRPC UNAVAILABLE)."""


class DeadlineExceededError(JengineError, TimeoutError):
    """The request's deadline passed before it finished (HTTP 504, gRPC DEADLINE_EXCEEDED)."""


class ConfigError(JengineError, ValueError):
    """An engine or model configuration that cannot work, found at start-up."""


class UnsupportedModelError(ConfigError):
    """A checkpoint whose architecture or settings jengine does not implement."""


class CheckpointError(JengineError, OSError):
    """A model directory or weight file that is missing, unreadable or inconsistent."""


class AdapterError(InvalidRequestError):
    """A LoRA adapter that cannot be served: missing or unreadable, an option not supported, a rank over the limit,
    shapes that do not fit the base model (HTTP 400, gRPC INVALID_ARGUMENT)."""

    def __init__(self, message: str, *, param: str | None = "lora_path") -> None:
        super().__init__(message, param=param, code="invalid_lora_adapter")
