"""The CPU KV cache costs memory only where it is written."""

from __future__ import annotations

import gc

import torch

from specbatch.cache.kv_tensors import allocate_kv_caches, lazy_zeros
from specbatch.models.config import ModelConfig


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_lazy_zeros_commit_memory_as_written_and_release_it() -> None:
    before = rss_bytes()
    cache = lazy_zeros((4096, 16, 8, 128), torch.float32)  # 256 MiB reserved
    assert rss_bytes() - before < 32 << 20
    assert not cache[::97].any()  # reads see zeros (reading commits no private pages)
    cache[:512] = 1.0  # 32 MiB written
    grown = rss_bytes() - before
    assert 28 << 20 < grown < 64 << 20
    assert cache.sum().item() == 512 * 16 * 8 * 128
    del cache
    gc.collect()
    assert rss_bytes() - before < 16 << 20


def test_bf16_caches_per_layer() -> None:
    config = ModelConfig("LlamaForCausalLM", 32, 64, 128, 3, 4, 2, 16, 256)
    caches = allocate_kv_caches(config, 10, 4, torch.bfloat16, "cpu")
    assert len(caches) == 3
    for key, value in caches:
        assert key.shape == value.shape == (10, 4, 2, 16)
        assert key.dtype == torch.bfloat16
        assert key.data_ptr() != value.data_ptr()
        key[3, 1] = 2.5
        assert key[3, 1].float().sum().item() == 2.5 * 32
        assert not value.any()
