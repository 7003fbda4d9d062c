"""One exception base for the package; the CLI prints these as one line and exits 1."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from client.session import ModelResult


class PerfClientError(Exception):
    """A user-facing error: bad option, unreachable server, unknown model, bad input data."""


class UsageConflict(PerfClientError):
    """Two options that do not go together: a usage error (the CLI exits 2, as on argparse's own), found before
    any connection."""


class RunAborted(PerfClientError):
    """The run stopped part-way (the server died); `partial` holds what was measured before, the
    last level possibly incomplete (`result.complete` False)."""

    def __init__(self, message: str, partial: list[ModelResult]) -> None:
        super().__init__(message)
        self.partial = partial
