"""Engine configuration validation and the CLI's argument parsing (no model needed)."""

from __future__ import annotations

import argparse

import pytest

from vmkv.engine.args import parse_size
from vmkv.engine.cli import add_arguments
from vmkv.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from vmkv.paged.options import PagedOptions
from vmkv.vmem.options import VMemOptions


def test_defaults():
    c = EngineConfig()
    assert c.cache == CacheConfig() and c.scheduler == SchedulerConfig()
    assert (c.cache.backend, c.cache.block_size, c.cache.layout, c.cache.driver) == \
        ("paged", 16, "megacache", "auto")
    assert (c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens) == (64, 2048)
    assert c.cache.backend_options() == PagedOptions(block_size=16, enable_prefix_caching=True)
    assert CacheConfig(backend="vmem").backend_options() == VMemOptions(
        driver="auto", layout="megacache", page_size_bytes=None, enable_prefix_caching=True)


@pytest.mark.parametrize("make, message", [
    (lambda: CacheConfig(backend="blocks"), "CacheConfig.backend must be one of"),
    (lambda: CacheConfig(memory_bytes=0), "CacheConfig.memory_bytes must be a positive int"),
    (lambda: CacheConfig(gpu_memory_utilization=1.5), "gpu_memory_utilization must be in (0, 1], got 1.5"),
    (lambda: CacheConfig(block_size=24), "power of two"),
    (lambda: CacheConfig(layout="flat"), "CacheConfig.layout"),
    (lambda: CacheConfig(driver="rocm"), "CacheConfig.driver"),
    (lambda: SchedulerConfig(max_num_seqs=0), "SchedulerConfig.max_num_seqs"),
    (lambda: SchedulerConfig(max_num_batched_tokens=-5), "max_num_batched_tokens"),
    (lambda: SchedulerConfig(max_model_len=4096, max_num_batched_tokens=512,
                             enable_chunked_prefill=False), "enable_chunked_prefill is False"),
    (lambda: EngineConfig(dtype="int8"), "EngineConfig.dtype"),
    (lambda: EngineConfig(seed=-1), "EngineConfig.seed"),
])
def test_validation_names_field_and_value(make, message):
    with pytest.raises(ValueError) as e:
        make()
    assert message in str(e.value)


def test_frozen():
    with pytest.raises(Exception):
        CacheConfig().backend = "vmem"


def test_from_args_routes_knobs():
    c = EngineConfig.from_args("m", "vmem", "cpu", "float32", memory_bytes=1 << 20, max_num_seqs=4,
                               layout="per_layer", seed=3, max_model_len=128)
    assert (c.model, c.device, c.dtype, c.seed) == ("m", "cpu", "float32", 3)
    assert (c.cache.backend, c.cache.memory_bytes, c.cache.layout) == ("vmem", 1 << 20, "per_layer")
    assert (c.scheduler.max_num_seqs, c.scheduler.max_model_len) == (4, 128)
    with pytest.raises(TypeError, match="max_batch"):
        EngineConfig.from_args(max_batch=3)


def test_parse_size():
    assert parse_size("268435456") == 268435456
    assert parse_size("256MiB") == 256 << 20
    assert parse_size("4KiB") == 4096 and parse_size("1.5G") == 3 << 29 and parse_size("64k") == 65536
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("lots")


def test_cli_defaults_come_from_the_configs():
    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args(["--prompt", "hi"])
    assert (a.backend, a.block_size, a.max_num_seqs, a.max_num_batched_tokens) == ("paged", 16, 64, 2048)
    assert a.chat is None and a.temperature == 0.0 and a.memory_bytes is None
    a = p.parse_args(["--prompt", "hi", "--backend", "vmem", "--no-chat", "--memory-bytes", "1GiB"])
    assert (a.backend, a.chat, a.memory_bytes) == ("vmem", False, 1 << 30)
