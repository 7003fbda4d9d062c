"""Fitting a served output to the one expected of it, for verify and perfclient --validate."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray


def fitted(have: NDArray[Any], want: NDArray[Any], *, batched: bool = False) -> NDArray[Any] | None:
    """`have` in `want`'s shape, or None where it cannot be. A scalar comes back from Triton as [1]; an output
    whose size depends on the data (a TTS model's audio) is expected padded with exact zeros to the largest of its
    samples (builder.runtimes.base stacks them so), so a shorter answer is padded the same way, but only where
    the expected values it would be compared with there are all exactly zero: a truncated answer against real
    values is a mismatch. `batched`: axis 0 is the request's batch, which an answer never pads."""
    if have.size == want.size:
        return have.reshape(want.shape)
    if have.ndim != want.ndim or any(h > w for h, w in zip(have.shape, want.shape, strict=True)):
        return None
    if batched and have.shape[:1] != want.shape[:1]:
        return None
    padded = np.pad(have, [(0, w - h) for h, w in zip(have.shape, want.shape, strict=True)])
    inside = np.zeros(want.shape, dtype=bool)
    inside[tuple(slice(0, h) for h in have.shape)] = True
    if np.any(want[~inside] != 0):
        return None
    return padded
