"""``BackendOptions``: the base of each KV backend's typed, frozen options (torch-free).

A backend declares its options beside its implementation (``PagedOptions`` in the paged package's
``options`` module, ``VMemOptions`` in the vmem package's) as a frozen dataclass whose fields carry a check in their
metadata::

    @dataclass(frozen=True)
    class PagedOptions(BackendOptions):
        block_size: int = option(16, power_of_two(1, 1024), "tokens per block")

The registry (:mod:`vmkv.kvcache.registry`) maps the backend name to the class.  A field is the one
declaration of its option: ``CacheConfig``'s field of the same name, the CLI flag (``--block-size``: the
name with dashes, or ``flag=``; its parser and metavar from the check, its help from ``help``), and the
flag the comparison harnesses write into a ``vmkv serve`` command line are all derived from it
(:mod:`vmkv.engine.config`, :mod:`vmkv.engine.option_args`).  Adding an option touches its options class
(and the implementation) only.  Every field's keyword is the backend constructor's keyword of the same
name (:meth:`BackendOptions.as_kwargs`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from vmkv.kvcache.sizes import parse_size, size_or_zero

__all__ = ["BackendOptions", "Check", "option", "one_of", "positive_int", "non_negative_int",
           "power_of_two", "boolean", "size_bytes"]


@dataclass(frozen=True)
class Check:
    """A field's check: ``test(value)`` is True for a valid value; ``allowed`` says what is valid
    (for the error message); ``choices`` is the name list of a choice field (``None`` otherwise);
    ``parse`` turns the CLI text into a value (argparse ``type=``; ``None``: the text itself, or a
    ``--x/--no-x`` flag for a ``boolean()``); ``metavar`` names the value in ``--help``."""

    test: Callable[[Any], bool]
    allowed: str
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    is_flag: bool = False


def one_of(names: tuple[str, ...]) -> Check:
    """One of ``names`` (a name list the options module owns)."""
    return Check(lambda v: isinstance(v, str) and v in names, f"one of {list(names)}", tuple(names))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def positive_int(allow_none: bool = False) -> Check:
    """An int >= 1 (or ``None`` when ``allow_none``)."""
    return Check(lambda v: (v is None and allow_none) or (_is_int(v) and v >= 1),
                 "a positive int" + (" or None" if allow_none else ""), parse=int, metavar="N")


def non_negative_int() -> Check:
    """An int >= 0."""
    return Check(lambda v: _is_int(v) and v >= 0, "an int >= 0", parse=int, metavar="N")


def size_bytes(allow_none: bool = False, allow_zero: bool = False) -> Check:
    """A byte count >= 1 (>= 0 when ``allow_zero``; or ``None`` when ``allow_none``), written on the
    command line as a size (``512MiB``: :func:`vmkv.kvcache.sizes.parse_size`)."""
    low = 0 if allow_zero else 1
    allowed = ("an int >= 0" if allow_zero else "a positive int") + (" or None" if allow_none else "")
    return Check(lambda v: (v is None and allow_none) or (_is_int(v) and v >= low), allowed,
                 parse=size_or_zero if allow_zero else parse_size, metavar="SIZE")


def power_of_two(low: int, high: int) -> Check:
    """A power of two in ``[low, high]``."""
    return Check(lambda v: _is_int(v) and low <= v <= high and v & (v - 1) == 0,
                 f"a power of two in [{low}, {high}]", parse=int)


def boolean() -> Check:
    """``True`` or ``False`` (not 0/1); on the command line ``--x`` / ``--no-x``."""
    return Check(lambda v: isinstance(v, bool), "a bool", is_flag=True)


def option(default: Any, check: Check, help: str, *, flag: str | None = None,  # noqa: A002 - argparse's word
           metavar: str | None = None, refused_elsewhere: bool = False) -> Any:
    """A dataclass field with its ``check`` and a one-line ``help`` (what the CLI prints).

    Args:
        flag: the CLI flag (default: ``--`` and the field name with dashes, vLLM's style).
        metavar: the value's name in ``--help`` (default: the check's).
        refused_elsewhere: a backend without this option refuses a value other than the default
            (instead of ignoring it), e.g. a kernel choice whose silent absence would mislabel a
            measurement.
    """
    return dataclasses.field(default=default, metadata={
        "check": check, "help": help, "flag": flag, "metavar": metavar,
        "refused_elsewhere": refused_elsewhere})


@dataclass(frozen=True)
class BackendOptions:
    """Base of the per-backend options: frozen, validated in ``__post_init__``.

    Raises:
        ValueError: a field is out of range; the message names the class, field, value and range.
    """

    #: the registry name of the backend these options belong to (set by each subclass)
    backend: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            self.check_field(f.name, getattr(self, f.name))

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def _field(cls, name: str) -> dataclasses.Field:
        for f in dataclasses.fields(cls):
            if f.name == name:
                return f
        raise ValueError(f"{cls.__name__} has no option {name!r}; its options are {list(cls.field_names())}")

    @classmethod
    def field_default(cls, name: str) -> Any:
        return cls._field(name).default

    @classmethod
    def field_choices(cls, name: str) -> tuple[str, ...] | None:
        """The name list of a choice field (``None`` for a field that is no choice)."""
        return cls._field(name).metadata["check"].choices

    @classmethod
    def field_help(cls, name: str) -> str:
        return cls._field(name).metadata["help"]

    @classmethod
    def field_type(cls, name: str) -> Any:
        """The field's annotation (a string under ``from __future__ import annotations``)."""
        return cls._field(name).type

    @classmethod
    def field_check(cls, name: str) -> Check:
        """The field's :class:`Check` (its test, parser, choices)."""
        return cls._field(name).metadata["check"]

    @classmethod
    def field_flag(cls, name: str) -> str:
        """The field's CLI flag: ``option(flag=...)``, else ``--`` and the name with dashes."""
        return cls._field(name).metadata.get("flag") or "--" + name.replace("_", "-")

    @classmethod
    def field_metavar(cls, name: str) -> str | None:
        """The value's name in ``--help``: ``option(metavar=...)``, else the check's (``SIZE``, ``N``)."""
        f = cls._field(name)
        return f.metadata.get("metavar") or f.metadata["check"].metavar

    @classmethod
    def field_refused_elsewhere(cls, name: str) -> bool:
        """Whether a backend without the field refuses a value other than its default."""
        return bool(cls._field(name).metadata.get("refused_elsewhere"))

    @classmethod
    def check_field(cls, name: str, value: Any, owner: str | None = None) -> None:
        """Raise ``ValueError`` naming ``owner.name`` (default owner: this class), the value and the
        allowed range when ``value`` is not valid for the field ``name``."""
        check: Check = cls._field(name).metadata["check"]
        if not check.test(value):
            raise ValueError(f"{owner or cls.__name__}.{name} must be {check.allowed}, got {value!r}")

    def as_kwargs(self) -> dict[str, Any]:
        """The backend constructor's keyword arguments (one per field)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
