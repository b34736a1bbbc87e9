"""The Redis URL a component connects to: from ``--redis-url`` or from a file.

A URL carrying a password (``redis://user:password@host:6379/0``) given as a flag is in
the process's command line, which ``ps`` and ``/proc/PID/cmdline`` show to everyone on
the host. ``--redis-url-file`` reads it from a file instead: a Kubernetes Secret or a
compose secret mounted into the container, as the deployments in ``deploy/k8s/`` and
``compose/`` do. An empty or unreadable file is an error at start (fail closed), never
a silent fall-back to an unauthenticated Redis.
"""

from __future__ import annotations

import urllib.parse

from prefix_router.core.errors import StartupError

SCHEMES = ("redis", "rediss", "unix")
"""What redis-py's ``from_url`` accepts: plain TCP, TLS (``rediss``), a Unix socket."""


def resolve_redis_url(url: str | None, url_file: str | None) -> str | None:
    """``--redis-url`` or the stripped contents of ``--redis-url-file`` (at most one)."""
    if url_file is None:
        return url
    if url is not None:
        raise StartupError("give --redis-url or --redis-url-file, not both")
    try:
        with open(url_file) as f:
            text = f.read().strip()
    except OSError as exc:
        raise StartupError(f"cannot read --redis-url-file {url_file}: {exc}") from None
    if not text:
        raise StartupError(
            f"--redis-url-file {url_file} is empty: put the Redis URL in it, e.g. "
            "redis://USER:PASSWORD@HOST:6379/0 (see docs/deployment.md)"
        )
    scheme = urllib.parse.urlsplit(text).scheme
    if scheme not in SCHEMES:
        raise StartupError(
            f"--redis-url-file {url_file}: the URL's scheme is {scheme or 'missing'!r}, "
            f"expected one of {', '.join(SCHEMES)}"
        )
    return text


def redacted(url: str) -> str:
    """``url`` with its password replaced by ``***``, for logs and error messages."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port is not None else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


__all__ = ["SCHEMES", "redacted", "resolve_redis_url"]
