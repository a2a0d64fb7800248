"""Backend options on command lines, derived from the options classes' fields (never listed here).

    add_backend_option_args(parser)            # --block-size, --page-size-bytes, ..., --kv-shrink-grace-s
    backend_option_values(args)                # {"block_size": 16, "page_size_bytes": None, ...}
    option_argv("kv_reserve_bytes", 0)         # ["--kv-reserve", "0"]: what a harness writes for serve

Each option is one field of a backend's options class (:mod:`vmkv.kvcache.options`): its flag
(``option(flag=...)``, else ``--`` and the field name with dashes, vLLM's style), its parser and
metavar (from the field's check: a size for ``size_bytes()``, ``--x/--no-x`` for ``boolean()``, the
name list as ``choices``), its help and default come from that field, and the flag's dest is the field
name.  So ``serve``/``generate`` (:mod:`vmkv.engine.args`), the comparison harnesses and the command
lines they build for ``vmkv serve`` pick up a new option without an edit here.
"""

from __future__ import annotations

import argparse
from typing import Any, Iterable

from vmkv.kvcache.registry import backend_choices, backend_options_class, option_backends, option_names, option_owner

__all__ = ["option_choices", "option_help", "option_flag", "add_option_arg", "add_backend_option_args",
           "backend_option_values", "option_argv", "REFUSED_NOTE"]

#: appended to the help of an option declared ``refused_elsewhere`` (serve, generate)
REFUSED_NOTE = "; other backends refuse a value but the default"


def option_choices(name: str) -> tuple[str, ...]:
    """The ``choices`` of the backend option ``name`` (``"layout"``, ``"driver"``,
    ``"attention_impl"``): the name list of the options class that owns it, read through the registry
    (a name added to the vmem options module's ``LAYOUTS`` is a ``--layout`` choice at once)."""
    seen: dict[str, None] = {}
    for backend in option_backends(name):
        seen.update(dict.fromkeys(backend_options_class(backend).field_choices(name) or ()))
    return tuple(seen)


def option_help(name: str, extra: str = "", default_text: str = "%(default)s") -> str:
    """``--help`` text of the backend option ``name``: its options class's help line (prefixed with
    the backends that take it when not all do), ``extra``, and ``default_text`` (argparse's
    ``%(default)s`` unless given) unless the line says its default."""
    owners = option_backends(name)
    text = option_owner(name).field_help(name)
    if len(owners) < len(backend_choices()) and not text.startswith(owners[0] + ":"):
        text = f"{'/'.join(owners)}: {text}"
    return text + extra + ("" if "default:" in text else f" (default: {default_text})")


def _size_text(num_bytes: Any) -> str:
    """``64 MiB`` for 67108864 (a size default in ``--help``); other values as argparse shows them."""
    if isinstance(num_bytes, int) and not isinstance(num_bytes, bool) and num_bytes > 0:
        for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
            if num_bytes % (1 << shift) == 0:
                return f"{num_bytes >> shift} {unit}"
    return "%(default)s"


def option_flag(name: str, flags: dict[str, str] | None = None) -> str:
    """The CLI flag of option ``name``: ``flags[name]`` (a harness's own name for it), else the
    options field's (``--kv-reserve`` for ``kv_reserve_bytes``, ``--block-size`` for ``block_size``)."""
    return (flags or {}).get(name) or option_owner(name).field_flag(name)


def add_option_arg(g, name: str, *, flag: str | None = None, default: Any = None, note: str = "") -> None:
    """Add the flag of backend option ``name`` to ``g`` (dest: ``name``; ``default``: the field's
    unless given; ``note``: appended to the help)."""
    cls = option_owner(name)
    check = cls.field_check(name)
    kwargs: dict[str, Any] = {"dest": name, "default": cls.field_default(name) if default is None else default}
    default_text = _size_text(kwargs["default"]) if check.metavar == "SIZE" else "%(default)s"
    if check.is_flag:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        if check.choices is not None:
            kwargs["choices"] = option_choices(name)
        if check.parse is not None:
            kwargs["type"] = check.parse
        if cls.field_metavar(name) and check.choices is None:
            kwargs["metavar"] = cls.field_metavar(name)
    if cls.field_refused_elsewhere(name):
        note = note or REFUSED_NOTE
    g.add_argument(flag or cls.field_flag(name), help=option_help(name, note, default_text), **kwargs)


def add_backend_option_args(g, *, flags: dict[str, str] | None = None, skip: Iterable[str] = (),
                            defaults: dict[str, Any] | None = None, refused_note: str = "") -> None:
    """Add one flag per backend option (every field of every registered options class, in
    registration order) to ``g``, but those in ``skip``.

    Args:
        flags: option name -> a flag name of the caller's own (``compare engine``'s ``--page-size``).
        defaults: option name -> the caller's default (``compare colocate``'s shorter grace).
        refused_note: help note of the options declared ``refused_elsewhere`` (default:
            :data:`REFUSED_NOTE`).
    """
    skip = set(skip)
    for name in option_names():
        if name not in skip:
            note = refused_note if option_owner(name).field_refused_elsewhere(name) else ""
            add_option_arg(g, name, flag=(flags or {}).get(name), default=(defaults or {}).get(name), note=note)


def backend_option_values(args: argparse.Namespace, names: Iterable[str] | None = None) -> dict[str, Any]:
    """``{option: value}`` of the backend-option flags in ``args`` (dest = option name; ``names``:
    default every option)."""
    return {n: getattr(args, n) for n in (option_names() if names is None else names)}


def option_argv(name: str, value: Any, flags: dict[str, str] | None = None) -> list[str]:
    """The command-line words that give backend option ``name`` the value ``value`` (``vmkv serve``'s
    flag unless ``flags`` names another): ``[]`` for ``None``, ``--x``/``--no-x`` for a boolean,
    ``[flag, str(value)]`` otherwise (the flag's parser reads it back to ``value``).

    Raises:
        ValueError: a value that has no text form (a driver object).
    """
    flag = option_flag(name, flags)
    check = option_owner(name).field_check(name)
    if value is None:
        return []
    if check.is_flag:
        return [flag if value else "--no-" + flag[2:]]
    if not isinstance(value, (str, int, float)):
        raise ValueError(f"option {name}={value!r} has no command-line form; give a name "
                         f"({list(option_choices(name))}) instead")
    return [flag, str(value)]
