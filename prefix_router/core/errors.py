"""Errors raised by prefix-router's core.

    PrefixRouterError
     +-- ConfigError          invalid settings; maps to HTTP 422 / exit code 2
     +-- FleetError           invalid fleet change (unknown or duplicate instance)
     +-- StartupError         a component could not start (port taken, binary missing)

Shells (gRPC, HTTP, CLI) map these to status codes; the core never does.
"""


class PrefixRouterError(Exception):
    """Base class of every error prefix-router raises on purpose."""


class ConfigError(PrefixRouterError):
    """A setting is out of range, of the wrong type, or inconsistent."""


class FleetError(PrefixRouterError):
    """A fleet change refers to an unknown instance or duplicates one."""


class StartupError(PrefixRouterError):
    """A component could not start; the message says which and why."""
