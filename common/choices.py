"""Closed sets of values (precisions, protocols, power sources, ...) as enums that print as their value.

Both packages parse command-line and models.toml strings through `Choice.parse`, so every
message names the flag or key and the allowed values the same way.
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

_C = TypeVar("_C", bound="Choice")


class Choice(str, Enum):
    """A str-valued enum: `str()`, f-strings and JSON give the plain value."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(str(member.value) for member in cls)

    @classmethod
    def parse(cls: type[_C], value: object, what: str, *, error: type[Exception]) -> _C:
        """The member whose value is `value`, or `error` naming `what` and the allowed values."""
        if isinstance(value, cls):
            return value
        for member in cls:
            if member.value == value:
                return member
        raise error(f"{what} {value!r}: expected one of {', '.join(cls.values())}")
