"""Errors raised by the simulator's core.

    SimError
     +-- SimConfigError       invalid settings; the CLI exits with code 2
     +-- SimStartupError      an instance could not start (port taken); the CLI exits with 1
     +-- EngineStoppedError   a request reached an engine that is shutting down; HTTP 503
     +-- RequestError         a request the API refuses; ``param`` names the offending field
          +-- BadRequestError     malformed or inconsistent request; HTTP 400
          +-- ModelNotFoundError  the request names a model this instance does not serve; HTTP 404

The core only raises these; the HTTP shell (``vllm_sim.app``) maps them to status codes and
OpenAI-style error bodies, so the core stays free of HTTP concerns.
"""

from __future__ import annotations


class SimError(Exception):
    """Base class of every error the simulator raises on purpose."""


class SimConfigError(SimError):
    """A setting is out of range, of the wrong type, or inconsistent."""


class SimStartupError(SimError):
    """An instance could not start; the message says which and why."""


class EngineStoppedError(SimError):
    """A request arrived while its instance was shutting down."""


class RequestError(SimError):
    """A request the API refuses; ``param`` names the offending field when there is one."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class BadRequestError(RequestError):
    """The request is malformed (JSON, types, ranges) or too long for the model."""


class ModelNotFoundError(RequestError):
    """The request names a model (or LoRA adapter) that this instance does not serve."""
