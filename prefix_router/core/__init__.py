"""The pure routing core: what a routing decision is, with no I/O.

    config     the one validated routing config model
    errors     the exception hierarchy
    fleet      instances and their states
    key        the prefix key of a request body
    ring       Envoy's RING_HASH, mirrored exactly
    table      the routing table: the ring plus what one decision needs, per version
    placement  where a new prefix starts
    spill      which candidate takes a request when its home is overloaded

Nothing here opens a socket, reads a clock it was not given, or imports an I/O library.
"""
