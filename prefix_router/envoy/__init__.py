"""Envoy's configuration, rendered by pure functions: the bootstrap, the model cluster, and
instance addresses as Envoy takes them (IP literals, resolved from names)."""
