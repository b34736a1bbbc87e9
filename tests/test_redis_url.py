"""``--redis-url-file``: the Redis URL from a mounted Secret, never a silent fall-back."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefix_router.core.errors import StartupError
from prefix_router.state.redis_url import redacted, resolve_redis_url


def test_the_flag_alone_and_nothing_at_all_pass_through() -> None:
    assert resolve_redis_url("redis://h:6379/0", None) == "redis://h:6379/0"
    assert resolve_redis_url(None, None) is None


@pytest.mark.parametrize(
    "text",
    ["redis://u:p@redis:6379/0\n", "  rediss://u:p@r:6380/0?ssl_cert_reqs=required  ", "unix:///s"],
)
def test_the_file_is_read_and_stripped(tmp_path: Path, text: str) -> None:
    path = tmp_path / "url"
    path.write_text(text)
    assert resolve_redis_url(None, str(path)) == text.strip()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "is empty"),
        ("\n  \n", "is empty"),
        ("redis-host:6379", "scheme"),
        ("http://u:p@h/0", "scheme"),
    ],
)
def test_an_empty_or_wrong_file_fails_closed(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "url"
    path.write_text(text)
    with pytest.raises(StartupError, match=message) as raised:
        resolve_redis_url(None, str(path))
    assert "p@" not in str(raised.value)  # the message never repeats a password


def test_a_missing_file_and_both_flags_are_errors(tmp_path: Path) -> None:
    with pytest.raises(StartupError, match="cannot read"):
        resolve_redis_url(None, str(tmp_path / "absent"))
    (tmp_path / "url").write_text("redis://h/0")
    with pytest.raises(StartupError, match="not both"):
        resolve_redis_url("redis://h/0", str(tmp_path / "url"))


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://user:secret@redis:6379/0", "redis://user:***@redis:6379/0"),
        ("rediss://:secret@h/1?ssl_cert_reqs=required", "rediss://:***@h/1?ssl_cert_reqs=required"),
        ("redis://[::1]:6379/0", "redis://[::1]:6379/0"),
        ("redis://u:s@[fd00::1]:7000/0", "redis://u:***@[fd00::1]:7000/0"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ],
)
def test_redacted_hides_only_the_password(url: str, shown: str) -> None:
    assert redacted(url) == shown
