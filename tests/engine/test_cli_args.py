"""The engine options shared by ``vmkv serve`` and ``vmkv generate`` (vmkv/engine/args.py), and
``vmkv generate`` on a tokenizer-less random-weight model."""

from __future__ import annotations

import argparse
import subprocess
import sys
from types import MappingProxyType

import pytest

from vmkv.engine.args import add_engine_args, engine_kwargs, parse_size
from vmkv.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from vmkv.kvcache.options import one_of
from vmkv.kvcache.registry import backend_options_class
from vmkv.paged.options import PagedOptions
from vmkv.vmem import options as vmem_options
from vmkv.vmem.options import VMemOptions

ENGINE_FLAGS = [
    "--model", "some/dir", "--backend", "vmem", "--device", "cpu", "--dtype", "float32",
    "--random-weights", "tiny", "--seed", "7", "--threads", "1",
    "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--max-model-len", "256",
    "--memory-bytes", "64MiB", "--block-size", "32", "--page-size-bytes", "128KiB",
    "--layout", "per_layer", "--driver", "host", "--attention-impl", "sdpa", "--lookahead-tokens", "32",
    "--preallocate", "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
    "--kv-reserve", "1MiB", "--kv-shrink-grace-s", "2.5", "--enforce-eager",
    "--cuda-graph-sizes", "2", "1",
    "--async-scheduling",
    "--tensor-parallel-size", "2",
    "--kv-reservation", "pow2",
]
EXPECTED_KWARGS = dict(
    model="some/dir", kv_backend="vmem", device="cpu", dtype="float32", seed=7, random_weights="tiny",
    max_num_seqs=8, max_num_batched_tokens=512, max_model_len=256, memory_bytes=64 << 20,
    gpu_memory_utilization=CacheConfig().gpu_memory_utilization, block_size=32,
    page_size_bytes=128 << 10, layout="per_layer", driver="host", attention_impl="sdpa",
    lookahead_tokens=32, preallocate=True, enable_prefix_caching=False, enable_chunked_prefill=False,
    kv_reserve_bytes=1 << 20, kv_shrink_grace_s=2.5, enforce_eager=True,
    cuda_graph_sizes=[2, 1],
    async_scheduling=True,
    tensor_parallel_size=2,
    kv_reservation="pow2",
)


def _parser(module: str) -> argparse.ArgumentParser:
    import importlib

    p = argparse.ArgumentParser()
    importlib.import_module(module).add_arguments(p)
    return p


@pytest.mark.parametrize("text, want", [
    ("4096", 4096), (4096, 4096), (" 12 ", 12), ("1B", 1),
    ("4KiB", 4096), ("64k", 65536), ("4Ki", 4096), ("256MiB", 256 << 20), ("512M", 512 << 20),
    ("2GiB", 2 << 30), ("1.5G", 3 << 29), ("1TiB", 1 << 40), ("0.5K", 512),
    ("2kB", 2000), ("2MB", 2_000_000), ("1.5GB", 1_500_000_000),
])
def test_parse_size(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("bad", ["", "lots", "12 parsecs", "0", "-3", "1.5 xb", "0.1", "GiB", 0, -1, True, "1e9"])
def test_parse_size_rejects(bad):
    with pytest.raises(argparse.ArgumentTypeError, match="256MiB"):
        parse_size(bad)


def test_parse_size_error_through_argparse(capsys):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--memory-bytes", "lots"])
    assert "argument --kv-memory/--memory-bytes: not a size: 'lots'" in capsys.readouterr().err


def test_defaults_come_from_the_configs():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    kw = engine_kwargs(p.parse_args([]))
    ec, cc, sc = EngineConfig(), CacheConfig(), SchedulerConfig()
    assert kw == dict(
        model=ec.model, kv_backend=cc.backend, device=ec.device, dtype=ec.dtype, seed=ec.seed,
        random_weights=ec.random_weights, enforce_eager=ec.enforce_eager,
        cuda_graph_sizes=ec.cuda_graph_sizes, async_scheduling=ec.async_scheduling, tensor_parallel_size=ec.tensor_parallel_size,
        max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens, max_model_len=sc.max_model_len,
        memory_bytes=cc.memory_bytes, gpu_memory_utilization=cc.gpu_memory_utilization,
        block_size=cc.block_size, page_size_bytes=cc.page_size_bytes, layout=cc.layout,
        driver=cc.driver, attention_impl=cc.attention_impl, lookahead_tokens=cc.lookahead_tokens,
        preallocate=cc.preallocate, enable_prefix_caching=cc.enable_prefix_caching,
        kv_reserve_bytes=cc.kv_reserve_bytes, kv_shrink_grace_s=cc.kv_shrink_grace_s,
        enable_chunked_prefill=sc.enable_chunked_prefill,
        kv_reservation=sc.kv_reservation)
    assert p.parse_args([]).threads is None           # torch's own thread count is left alone
    # the kwargs build a valid config as they are
    assert EngineConfig.from_args(**kw) == EngineConfig()


@pytest.mark.parametrize("module, extra", [("vmkv.server.cli", []),
                                           ("vmkv.engine.cli", ["--prompt-token-ids", "1,2"])])
def test_both_clis_take_the_same_engine_flags(module, extra):
    args = _parser(module).parse_args([*ENGINE_FLAGS, *extra])
    assert engine_kwargs(args) == EXPECTED_KWARGS
    assert args.threads == 1
    cfg = EngineConfig.from_args(**engine_kwargs(args))
    assert (cfg.seed, cfg.cache.layout, cfg.scheduler.enable_chunked_prefill) == (7, "per_layer", False)
    # the typed options the engine hands to create_kv_cache carry every backend flag
    assert cfg.cache.backend_options() == VMemOptions(
        driver="host", layout="per_layer", page_size_bytes=128 << 10, enable_prefix_caching=False,
        attention_impl="sdpa", lookahead_tokens=32, preallocate=True, kv_reserve_bytes=1 << 20,
        kv_shrink_grace_s=2.5)


@pytest.mark.parametrize("module, extra", [("vmkv.server.cli", []), ("vmkv.engine.cli", ["--prompt", "x"])])
def test_aliases_and_mutual_exclusion(module, extra):
    p = _parser(module)
    a = p.parse_args([*extra, "--no-prefix-caching", "--no-chunked-prefill"])
    assert (a.enable_prefix_caching, a.enable_chunked_prefill) == (False, False)
    a = p.parse_args([*extra, "--enable-prefix-caching", "--gpu-memory-utilization", "0.3"])
    assert (a.enable_prefix_caching, a.enable_chunked_prefill, a.gpu_memory_utilization) == (True, True, 0.3)
    for bad in (["--memory-bytes", "1GiB", "--gpu-memory-utilization", "0.5"], ["--threads", "0"],
                ["--backend", "blocks"]):
        with pytest.raises(SystemExit):
            p.parse_args([*extra, *bad])


def test_generate_seed_is_the_engine_seed_and_sampling_seed_the_requests():
    p = _parser("vmkv.engine.cli")
    a = p.parse_args(["--prompt", "x", "--seed", "3", "--sampling-seed", "5"])
    assert (a.seed, a.sampling_seed, engine_kwargs(a)["seed"]) == (3, 5, 3)
    with pytest.raises(SystemExit):                   # the old name is gone
        p.parse_args(["--prompt", "x", "--engine-seed", "3"])
    with pytest.raises(SystemExit):                   # exactly one of --prompt / --prompt-token-ids
        p.parse_args([])
    with pytest.raises(SystemExit):
        p.parse_args(["--prompt", "x", "--prompt-token-ids", "1"])
    assert p.parse_args(["--prompt-token-ids", " 5, 6 7"]).prompt_token_ids == [5, 6, 7]
    for bad in ("", "1,-2", "1,x", "1.5"):
        with pytest.raises(SystemExit):
            p.parse_args(["--prompt-token-ids", bad])


# ------------------------------------------------------------------ backend options on the command line
def _choices(parser: argparse.ArgumentParser, flag: str) -> tuple:
    return tuple(next(a for a in parser._actions if flag in a.option_strings).choices)


@pytest.mark.parametrize("module", ["vmkv.server.cli", "vmkv.engine.cli", "vmkv.compare.cli"])
def test_backend_option_choices_are_the_options_modules_name_lists(module):
    p = _parser(module)
    if module == "vmkv.compare.cli":                 # the options sit on `compare engine`
        p = p._subparsers._group_actions[0].choices["engine"]
    assert _choices(p, "--layout") == vmem_options.LAYOUTS
    assert _choices(p, "--driver") == vmem_options.DRIVERS
    assert _choices(p, "--attention-impl") == vmem_options.ATTENTION_IMPLS
    # the defaults are the options dataclasses' defaults
    a = p.parse_args(["--prompt", "x"] if module == "vmkv.engine.cli" else [])
    want = VMemOptions()
    assert (a.layout, a.driver, a.attention_impl) == (want.layout, want.driver, want.attention_impl)
    assert (a.lookahead_tokens, a.preallocate) == (want.lookahead_tokens, want.preallocate)
    assert a.block_size == PagedOptions().block_size
    # ... and so is the help line
    helps = {a.dest: a.help for a in p._actions}
    for name in ("lookahead_tokens", "preallocate"):
        assert helps[name].startswith(VMemOptions.field_help(name))


def test_a_name_added_to_a_name_list_is_a_choice(monkeypatch):
    """The CLIs read the name lists when they build the parser, through the registry: no copy to
    update.  The layout field's check is swapped for one listing one name more."""
    field = VMemOptions.__dataclass_fields__["layout"]
    more = (*vmem_options.LAYOUTS, "striped")
    monkeypatch.setattr(field, "metadata", MappingProxyType({**field.metadata, "check": one_of(more)}))
    assert backend_options_class("vmem").field_choices("layout") == more
    for module in ("vmkv.server.cli", "vmkv.engine.cli"):
        p = _parser(module)
        assert _choices(p, "--layout") == more
        assert "striped" in p.format_help()


def _engine_config(module: str, flags: list[str]) -> EngineConfig:
    extra = ["--prompt", "x"] if module == "vmkv.engine.cli" else []
    return EngineConfig.from_args(**engine_kwargs(_parser(module).parse_args([*extra, *flags])))


@pytest.mark.parametrize("module", ["vmkv.server.cli", "vmkv.engine.cli"])
def test_attention_impl_reaches_the_vmem_cache_options(module):
    cfg = _engine_config(module, ["--backend", "vmem", "--attention-impl", "sdpa"])
    assert cfg.cache.attention_impl == "sdpa"
    opts = cfg.cache.backend_options()
    assert isinstance(opts, VMemOptions) and opts.attention_impl == "sdpa"
    # the default is the options class's, on both backends
    assert _engine_config(module, ["--backend", "vmem"]).cache.backend_options().attention_impl == \
        VMemOptions().attention_impl
    assert _engine_config(module, []).cache.backend_options() == PagedOptions()


@pytest.mark.parametrize("module", ["vmkv.server.cli", "vmkv.engine.cli"])
def test_paged_refuses_a_vmem_attention_impl(module):
    with pytest.raises(ValueError, match=r"attention_impl='sdpa' is an option of the vmem backend.*"
                                         r"paged backend has no attention_impl"):
        _engine_config(module, ["--backend", "paged", "--attention-impl", "sdpa"])
    # the default is no request for another kernel, so a paged run takes it
    assert _engine_config(module, ["--backend", "paged", "--attention-impl", "auto"]).cache.backend == "paged"


def test_generate_refuses_a_vmem_attention_impl_on_paged_before_loading(capsys):
    from vmkv.cli import main

    rc = main(["generate", "--random-weights", "tiny", "--device", "cpu", "--prompt-token-ids", "1",
               "--backend", "paged", "--attention-impl", "sdpa"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "attention_impl='sdpa'" in err and "--backend vmem" in err and "Loading" not in err


def test_serve_refuses_a_vmem_attention_impl_on_paged(capsys):
    from vmkv.server.cli import run

    args = _parser("vmkv.server.cli").parse_args(["--random-weights", "tiny", "--device", "cpu",
                                                  "--backend", "paged", "--attention-impl", "sdpa"])
    assert run(args) == 2
    assert "attention_impl='sdpa' is an option of the vmem backend" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["vmkv.server.cli", "vmkv.engine.cli"])
def test_every_backend_option_has_an_engine_flag(module):
    """Each field of each backend's options class reaches ``engine_kwargs`` (and so CacheConfig)."""
    from vmkv.kvcache.registry import BACKENDS

    extra = ["--prompt", "x"] if module == "vmkv.engine.cli" else []
    kw = engine_kwargs(_parser(module).parse_args(extra))
    fields = {f for b in BACKENDS for f in backend_options_class(b).field_names()}
    assert fields <= set(kw)


@pytest.mark.parametrize("module", ["vmkv.server.cli", "vmkv.engine.cli"])
def test_lookahead_and_preallocate_reach_the_vmem_cache_options(module):
    cfg = _engine_config(module, ["--backend", "vmem", "--lookahead-tokens", "48", "--preallocate"])
    assert cfg.cache.backend_options() == VMemOptions(lookahead_tokens=48, preallocate=True)
    assert _engine_config(module, ["--backend", "vmem", "--no-preallocate"]).cache.backend_options() == VMemOptions()
    # a paged run ignores them, like the other vmem layout options
    assert _engine_config(module, ["--lookahead-tokens", "48", "--preallocate"]).cache.backend_options() == \
        PagedOptions()
    with pytest.raises(ValueError, match=r"^CacheConfig.lookahead_tokens must be an int >= 0, got -1$"):
        _engine_config(module, ["--backend", "vmem", "--lookahead-tokens", "-1"])


def test_generate_lookahead_and_preallocate_reach_the_vmem_cache(capsys):
    """`vmkv generate --backend vmem --lookahead-tokens N --preallocate`: the cache is built with them
    (the pool's pages exist before the first request) and greedy decoding is unchanged."""
    from vmkv.engine.llm_engine import LLMEngine

    kw = dict(kv_backend="vmem", driver="host", memory_bytes=1 << 20, seed=2)
    for preallocate in (False, True):
        engine = LLMEngine.from_args(random_weights="tiny", device="cpu", dtype="float32", lookahead_tokens=16,
                                     preallocate=preallocate, **kw)
        try:
            assert engine.kv_cache.lookahead_tokens == 16
            assert (engine.kv_cache.backend_stats()["num_pages_created"] > 0) is preallocate
        finally:
            engine.close()
    want = _greedy_ids([1, 2, 3], 5, **kw)
    from vmkv.cli import main

    assert main(["generate", "--random-weights", "tiny", "--device", "cpu", "--dtype", "float32", "--backend",
                 "vmem", "--driver", "host", "--memory-bytes", "1MiB", "--seed", "2", "--lookahead-tokens", "16",
                 "--preallocate", "--max-tokens", "5", "--ignore-eos", "--no-stream", "--prompt-token-ids",
                 "1,2,3"]) == 0
    assert capsys.readouterr().out == ",".join(map(str, want)) + "\n"


# ------------------------------------------------------------------ generate on random weights
def _greedy_ids(prompt_ids: list[int], max_tokens: int, **knobs) -> list[int]:
    from vmkv.engine.llm_engine import LLMEngine
    from vmkv.engine.sampling_params import SamplingParams

    engine = LLMEngine.from_args(random_weights="tiny", device="cpu", dtype="float32", **knobs)
    engine.add_request("r", None, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                       prompt_token_ids=prompt_ids)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    engine.close()
    return out.outputs[0].token_ids


@pytest.mark.parametrize("stream", [True, False])
def test_generate_random_weights_prints_token_ids(capsys, stream):
    from vmkv.cli import main

    common = ["generate", "--random-weights", "tiny", "--device", "cpu", "--dtype", "float32",
              "--memory-bytes", "1MiB", "--max-tokens", "6", "--ignore-eos", "--seed", "2"]
    assert main([*common, "--prompt-token-ids", "1,2,3", *([] if stream else ["--no-stream"])]) == 0
    out = capsys.readouterr().out
    want = _greedy_ids([1, 2, 3], 6, memory_bytes=1 << 20, seed=2)
    assert len(want) == 6
    assert out == ",".join(map(str, want)) + "\n"


def test_generate_random_weights_text_prompt_names_prompt_token_ids(capsys):
    from vmkv.cli import main

    rc = main(["generate", "--random-weights", "tiny", "--device", "cpu", "--prompt", "hello"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "no tokenizer" in err and "--prompt-token-ids" in err
    assert "Loading" not in err                       # refused before loading the model
    rc = main(["generate", "--random-weights", "tiny", "--device", "cpu", "--prompt-token-ids", "1", "--chat"])
    assert rc == 2 and "--chat applies to --prompt" in capsys.readouterr().err


def test_top_level_help_does_not_import_torch():
    code = ("import sys; from vmkv.cli import build_parser; build_parser(['--help']); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_text_prompt_to_any_tokenizerless_model_names_prompt_token_ids():
    from types import SimpleNamespace

    from vmkv.engine.cli import _prompt_ids

    engine = SimpleNamespace(tokenizer=None, model_name="some-gguf")
    args = _parser("vmkv.engine.cli").parse_args(["--prompt", "hi"])
    with pytest.raises(ValueError, match="some-gguf has no tokenizer.*--prompt-token-ids 1,2,3"):
        _prompt_ids(engine, args)
    args = _parser("vmkv.engine.cli").parse_args(["--prompt-token-ids", "4,5"])
    assert _prompt_ids(engine, args) == [4, 5]


def test_attention_impl_sdpa_reaches_the_vmem_cache_and_generates_the_same_tokens(capsys):
    """`vmkv generate --backend vmem --attention-impl sdpa`: the cache runs SDPA on slot views and
    greedy decoding matches the default implementation's."""
    from vmkv.engine.llm_engine import LLMEngine

    kw = dict(kv_backend="vmem", driver="host", memory_bytes=1 << 20, seed=2)
    engine = LLMEngine.from_args(random_weights="tiny", device="cpu", dtype="float32", attention_impl="sdpa", **kw)
    try:
        assert engine.kv_cache.attention_impl == "sdpa"
    finally:
        engine.close()
    want = _greedy_ids([1, 2, 3], 5, **kw)
    assert _greedy_ids([1, 2, 3], 5, attention_impl="sdpa", **kw) == want
    from vmkv.cli import main

    assert main(["generate", "--random-weights", "tiny", "--device", "cpu", "--dtype", "float32", "--backend",
                 "vmem", "--driver", "host", "--memory-bytes", "1MiB", "--seed", "2", "--attention-impl", "sdpa",
                 "--max-tokens", "5", "--ignore-eos", "--no-stream", "--prompt-token-ids", "1,2,3"]) == 0
    assert capsys.readouterr().out == ",".join(map(str, want)) + "\n"


def test_graph_flags_reach_the_config():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    kw = engine_kwargs(p.parse_args(["--enforce-eager", "--cuda-graph-sizes", "8", "1", "4"]))
    cfg = EngineConfig.from_args(**kw)
    assert cfg.enforce_eager is True and cfg.cuda_graph_sizes == (1, 4, 8)
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        EngineConfig(cuda_graph_sizes=(0,))


def test_tensor_parallel_size_flag_reaches_the_config():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert EngineConfig.from_args(**engine_kwargs(p.parse_args(["-tp", "4"]))).tensor_parallel_size == 4
    assert EngineConfig.from_args(**engine_kwargs(p.parse_args([]))).tensor_parallel_size == 1
    with pytest.raises(SystemExit):
        p.parse_args(["--tensor-parallel-size", "0"])
