"""The body answer ext_proc writes by hand equals the protobuf serialization, byte for byte."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ext_proc.servicer import route_response, route_response_message


@given(value=st.text(max_size=300))
def test_the_route_response_is_the_protobuf_serialization(value: str) -> None:
    assert route_response(value) == route_response_message(value).SerializeToString()


def test_a_long_header_value_needs_a_longer_length_and_still_matches() -> None:
    for size in (0, 1, 100, 127, 128, 16_383, 16_384, 70_000):
        value = "k" * size
        assert route_response(value) == route_response_message(value).SerializeToString()


@given(
    value=st.one_of(st.none(), st.text(max_size=300)),
    pool=st.one_of(st.none(), st.text(min_size=1, max_size=300)),
)
def test_with_a_pool_both_headers_and_the_route_cache_clear_match_the_serialization(
    value: str | None, pool: str | None
) -> None:
    assert route_response(value, pool) == route_response_message(value, pool).SerializeToString()
