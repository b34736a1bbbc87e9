"""prefix-router's Envoy External Processing server.

Reads the request's prefix, computes its key, and sets ``x-prefix-key`` so
Envoy's ring-hash load balancer sends it to the instance whose KV cache holds
that prefix, steering away from an overloaded one.
"""
