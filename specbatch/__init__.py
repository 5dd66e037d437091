"""specbatch: continuous batching over a paged KV cache, with lossless speculative decoding."""

__version__ = "0.1.0"
