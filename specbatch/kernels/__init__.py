"""Stateless compute: attention backends and KV-cache writes, packed CPU linears, sampling."""
