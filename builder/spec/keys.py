"""How error lines name a [[model]] table's keys: models.toml's key paths or the `trtbuild build` flags that fill
them. Plain Python (no pydantic), so the spec's dataclasses can name keys without importing the schema."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

Loc = tuple[str | int, ...]
Namer = Callable[[Loc], str]


def key_path(loc: Loc) -> str:
    """("model", 0, "serving", "x") → model[0].serving.x (keys that are not bare TOML keys are quoted)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            key = part if part.replace("_", "").replace("-", "").isalnum() else json.dumps(part)
            out += f".{key}" if out else key
    return out


class Keys(Protocol):
    """How error lines name the keys of one [[model]] table: models.toml's key paths, or the `trtbuild
    build` flags that fill them. Both entry points share the checks and so the text after the name."""

    def at(self, loc: Loc) -> str:
        """Where an error is (`model[0].shapes.x`, `--max-shapes x`); `loc` is within the table."""
        ...

    def give(self, loc: Loc) -> str:
        """How a user gives that key, for a line that asks for it (`a [model.calibration] table`,
        `--calibration FILE.npz`)."""
        ...


@dataclass(frozen=True)
class TomlKeys:
    """models.toml's names: key paths under `prefix` (("model", 2) → `model[2].precisions`)."""

    prefix: Loc = ()

    def at(self, loc: Loc) -> str:
        return key_path(self.prefix + loc)

    def give(self, loc: Loc) -> str:
        if loc == ("calibration",):
            return "a [model.calibration] table"
        if len(loc) == 2 and loc[0] == "dims":
            return f"{key_path(loc)} = [min, opt, max]"
        return key_path(loc)
