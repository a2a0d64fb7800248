"""``BackendOptions``: the base of each KV backend's typed, frozen options (torch-free).

A backend declares its options beside its implementation (``PagedOptions`` in the paged package's
``options`` module, ``VMemOptions`` in the vmem package's) as a frozen dataclass whose fields carry a check in their
metadata::

    @dataclass(frozen=True)
    class PagedOptions(BackendOptions):
        block_size: int = option(16, power_of_two(1, 1024), "tokens per block")

The registry (:mod:`vmkv.kvcache.registry`) maps the backend name to the class; the engine config and
the CLIs read the defaults, the allowed names (``field_choices``) and the checks from it, so a name list
lives once, in the backend's options module.  Every field's keyword is the backend constructor's keyword
of the same name (:meth:`BackendOptions.as_kwargs`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

__all__ = ["BackendOptions", "Check", "option", "one_of", "positive_int", "non_negative_int",
           "power_of_two", "boolean"]


@dataclass(frozen=True)
class Check:
    """A field's check: ``test(value)`` is True for a valid value; ``allowed`` says what is valid
    (for the error message); ``choices`` is the name list of a choice field (``None`` otherwise)."""

    test: Callable[[Any], bool]
    allowed: str
    choices: tuple[str, ...] | None = None


def one_of(names: tuple[str, ...]) -> Check:
    """One of ``names`` (a name list the options module owns)."""
    return Check(lambda v: isinstance(v, str) and v in names, f"one of {list(names)}", tuple(names))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def positive_int(allow_none: bool = False) -> Check:
    """An int >= 1 (or ``None`` when ``allow_none``)."""
    return Check(lambda v: (v is None and allow_none) or (_is_int(v) and v >= 1),
                 "a positive int" + (" or None" if allow_none else ""))


def non_negative_int() -> Check:
    """An int >= 0."""
    return Check(lambda v: _is_int(v) and v >= 0, "an int >= 0")


def power_of_two(low: int, high: int) -> Check:
    """A power of two in ``[low, high]``."""
    return Check(lambda v: _is_int(v) and low <= v <= high and v & (v - 1) == 0,
                 f"a power of two in [{low}, {high}]")


def boolean() -> Check:
    """``True`` or ``False`` (not 0/1)."""
    return Check(lambda v: isinstance(v, bool), "a bool")


def option(default: Any, check: Check, help: str) -> Any:  # noqa: A002 - argparse's word
    """A dataclass field with its ``check`` and a one-line ``help`` (what the CLI prints)."""
    return dataclasses.field(default=default, metadata={"check": check, "help": help})


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
    def check_field(cls, name: str, value: Any, owner: str | None = None) -> None:
        """Raise ``ValueError`` naming ``owner.name`` (default owner: this class), the value and the
        allowed range when ``value`` is not valid for the field ``name``."""
        check: Check = cls._field(name).metadata["check"]
        if not check.test(value):
            raise ValueError(f"{owner or cls.__name__}.{name} must be {check.allowed}, got {value!r}")

    def as_kwargs(self) -> dict[str, Any]:
        """The backend constructor's keyword arguments (one per field)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
