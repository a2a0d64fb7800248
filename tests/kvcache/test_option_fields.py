"""A backend option is declared once, as a field of its options class (issue 23 item 3): the CLI flag,
``CacheConfig``'s field, ``engine_kwargs`` and the harnesses' ``vmkv serve`` command lines are derived
from it.  These tests check every declared field, and add a throwaway field to prove that nothing else
needs an edit for a new option."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import textwrap

import pytest

from vmkv.compare.serve_proc import serve_argv
from vmkv.engine.args import add_engine_args, engine_kwargs
from vmkv.engine.config import BACKEND_OPTION_FIELDS, CacheConfig, EngineConfig
from vmkv.engine.option_args import option_argv
from vmkv.kvcache.registry import BACKENDS, backend_options_class, option_names, option_owner
from vmkv.server import cli as serve_cli

FIELDS = [(b, n) for b in BACKENDS for n in backend_options_class(b).field_names()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def _flags(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in p._actions for s in a.option_strings}


def _other_value(cls, name: str):
    """A valid value of option ``name`` other than its default, chosen from the field's check."""
    default, check = cls.field_default(name), cls.field_check(name)
    if check.is_flag:
        return not default
    if check.choices is not None:
        return next(c for c in check.choices if c != default)
    if check.metavar == "SIZE":
        return (4 << 20) if default == 2 << 20 else 2 << 20
    if check.parse is float:
        return 2.5 if default != 2.5 else 1.5
    for value in (default * 2, default + 8, default // 2):
        if check.test(value):
            return value
    raise AssertionError(f"no test value for {cls.__name__}.{name}")


def test_every_option_is_a_cache_config_field_with_its_type_and_default():
    assert set(BACKEND_OPTION_FIELDS) == set(option_names()) == {n for _, n in FIELDS}
    cc_fields = {f.name: f for f in dataclasses.fields(CacheConfig)}
    for backend, name in FIELDS:
        cls = backend_options_class(backend)
        assert cc_fields[name].default == cls.field_default(name), name
        assert cc_fields[name].type == option_owner(name).field_type(name), name


@pytest.mark.parametrize("backend, name", FIELDS)
def test_every_option_has_a_flag_and_help_and_round_trips(backend, name):
    """The flag exists (vLLM-style: dashes, ``--kv-reserve`` as declared), has help text and the field's
    default; a non-default value goes CLI -> engine_kwargs -> CacheConfig -> backend kwargs unchanged, and
    ``option_argv`` (what the harnesses write) reads back through serve's own parser."""
    cls = backend_options_class(backend)
    flag = cls.field_flag(name)
    assert flag.startswith("--") and flag == flag.lower() and "_" not in flag
    action = _flags(_parser())[flag]
    assert action.dest == name and action.default == cls.field_default(name)
    assert action.help and cls.field_help(name) in action.help % {"default": action.default}
    value = _other_value(cls, name)
    cls.check_field(name, value)
    argv = ["--backend", backend, *option_argv(name, value)]
    kwargs = engine_kwargs(_parser().parse_args(argv))
    assert kwargs[name] == value
    cfg = EngineConfig.from_args(**kwargs)
    assert getattr(cfg.cache, name) == value
    opts = cfg.cache.backend_options()
    assert type(opts) is cls and opts == cls(**{name: value}) and opts.as_kwargs()[name] == value


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_options_at_once_and_the_defaults_round_trip(backend):
    cls = backend_options_class(backend)
    assert EngineConfig.from_args(**engine_kwargs(_parser().parse_args(["--backend", backend]))) \
        .cache.backend_options() == cls()
    values = {n: _other_value(cls, n) for n in cls.field_names()}
    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    ns = p.parse_args(serve_argv({"backend": backend, "knobs": values}, 8000))
    assert EngineConfig.from_args(**engine_kwargs(ns)).cache.backend_options() == cls(**values)


# a throwaway option on a subclass of VMemOptions, registered as the vmem backend's options class before
# anything derives from the registry; run in a child so that no module of this process is rebuilt
_EXTRA_OPTION = textwrap.dedent('''
    import argparse
    from dataclasses import dataclass
    from vmkv.kvcache import registry
    from vmkv.kvcache.options import non_negative_int, option
    from vmkv.vmem.options import VMemOptions

    @dataclass(frozen=True)
    class VMemPlus(VMemOptions):
        burst_tokens: int = option(0, non_negative_int(), "vmem: a throwaway option for the test")

    registry._BACKENDS["vmem"] = (registry._BACKENDS["vmem"][0], "__main__:VMemPlus")

    from vmkv.compare import colocate, engine_bench
    from vmkv.compare.serve_proc import serve_argv
    from vmkv.engine.args import engine_kwargs
    from vmkv.engine.config import BACKEND_OPTION_FIELDS, CacheConfig, EngineConfig
    from vmkv.paged.options import PagedOptions
    from vmkv.server.cli import add_arguments

    def serve_parser():
        p = argparse.ArgumentParser()
        add_arguments(p)
        return p

    # config plumbing
    assert "burst_tokens" in BACKEND_OPTION_FIELDS and CacheConfig().burst_tokens == 0
    # the flag of serve/generate, its help, and the CLI -> config -> backend options path
    assert "a throwaway option" in serve_parser().format_help()
    ns = serve_parser().parse_args(["--backend", "vmem", "--burst-tokens", "5"])
    cfg = EngineConfig.from_args(**engine_kwargs(ns))
    assert cfg.cache.burst_tokens == 5 and cfg.cache.backend_options() == VMemPlus(burst_tokens=5)
    assert cfg.cache.backend_options().as_kwargs()["burst_tokens"] == 5
    ns = serve_parser().parse_args(["--backend", "paged", "--burst-tokens", "5"])
    assert EngineConfig.from_args(**engine_kwargs(ns)).cache.backend_options() == PagedOptions()
    # compare engine: its flag, the vmem run's knobs only, and the vmkv serve command line built from them
    p = argparse.ArgumentParser()
    engine_bench.add_arguments(p)
    args = p.parse_args(["--burst-tokens", "5"])
    engine_bench.check_backends(args, ["paged", "vmem"])
    vmem, paged = engine_bench._knobs(args, 256, "vmem"), engine_bench._knobs(args, 256, "paged")
    assert vmem["burst_tokens"] == 5 and "burst_tokens" not in paged
    argv = serve_argv({"backend": "vmem", "knobs": vmem}, 8000)
    assert argv[argv.index("--burst-tokens") + 1] == "5"
    assert engine_kwargs(serve_parser().parse_args(argv))["burst_tokens"] == 5
    try:
        engine_bench.check_backends(args, ["paged"])
        raise AssertionError("a vmem-only option without a vmem run was accepted")
    except ValueError as e:
        assert "--burst-tokens is an option of the vmem backend" in str(e), e
    # compare colocate passes it to its vmem servers
    p = argparse.ArgumentParser()
    colocate.add_arguments(p)
    cmd = colocate._serve_cmd(p.parse_args(["--burst-tokens", "7"]), 18500, 1 << 30)
    assert cmd[cmd.index("--burst-tokens") + 1] == "7"
    print("OK")
''')


def test_an_option_added_to_the_options_class_reaches_every_place():
    """One field on the vmem options class (a subclass here) gives serve's flag and help, the
    ``CacheConfig`` field, the backend options, ``compare engine``'s flag and knobs, and the ``vmkv serve``
    command lines of ``compare serve`` and ``compare colocate``: no other edit."""
    r = subprocess.run([sys.executable, "-c", _EXTRA_OPTION], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr
