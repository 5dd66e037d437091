"""Stateless compute: attention backends, KV writes, sampling and rejection sampling."""
