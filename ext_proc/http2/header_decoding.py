"""HPACK decoding of request headers (RFC 7541), with repeated header blocks decoded once.

Envoy opens every ext_proc stream with the same request headers, and it encodes
``:path`` as a Huffman-coded literal every time (HPACK encoders do not index paths):
the ``hpack`` package, pure Python, spends ~10 us a stream decoding the same bytes.
We advertise ``SETTINGS_HEADER_TABLE_SIZE = 0``, so once Envoy has applied it (it
says so with a table size update) its header blocks never use the dynamic table and
a block's headers depend on its bytes alone: those are looked up, not decoded.

The lookup is taken only while it is exact. A block's headers, and what it does to the
decoder, depend on the block and the decoder's state: the dynamic table and its size
limit. So a block is remembered only when it was decoded with an empty table that it
left empty, under a limit it left alone (it does not start with a size update), and
looked up only with an empty table under that same limit. (An insertion is a no-op under
a limit of 0 but not under 4,096: keyed without the limit, a block seen under one and
replayed under the other came back without its insertion, which a property test found.)
Anything else (the first blocks, before Envoy applied our setting; a peer that ignores
it) is decoded in full, as always.
"""

from __future__ import annotations

import hpack

Headers = tuple[tuple[bytes, bytes], ...]

TABLE_SIZE = 0
"""The dynamic table size we allow the peer's encoder."""
CACHE_ENTRIES = 64
"""Distinct header blocks remembered; a peer that sends more just costs full decodes."""


class HeaderBlockDecoder:
    def __init__(self, max_header_list_size: int) -> None:
        self._decoder = hpack.Decoder(max_header_list_size=max_header_list_size)
        self._table = self._decoder.header_table
        self._seen: dict[tuple[int, bytes], Headers] = {}

    def decode(self, block: bytes) -> Headers:
        """The headers of ``block``; raises ``hpack.HPACKError`` (or ``ValueError``) if it
        does not decode."""
        table = self._table
        stateless = not table.dynamic_entries and not (block[:1] and block[0] & 0xE0 == 0x20)
        key = (table.maxsize, block)
        if stateless:
            headers = self._seen.get(key)
            if headers is not None:
                return headers
        headers = tuple(self._decoder.decode(block, raw=True))
        if stateless and not table.dynamic_entries and table.maxsize == key[0]:
            if len(self._seen) >= CACHE_ENTRIES:
                self._seen.clear()
            self._seen[key] = headers
        return headers
