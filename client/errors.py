"""One exception base for the package; the CLI prints these as one line and exits 1."""

from __future__ import annotations


class PerfClientError(Exception):
    """A user-facing error: bad option, unreachable server, unknown model, bad input data."""


class UsageConflict(PerfClientError):
    """Two options that do not go together: a usage error (the CLI exits 2, as on argparse's own), found before
    any connection."""
