"""`--validate FILE.npz`: send the samples `trtbuild verify --save` stored and check every answer.

The file holds `<model>/input/<name>` and `<model>/output/<name>` arrays with a leading sample axis:
the samples sent and the outputs the local run (under the runtime that built the artifact) gave.
Each payload is a slice of the samples, cut as `--input-data FILE.npz` cuts them, and carries a `Check`:
the same slice of the expected outputs, the tolerances (`--validate-atol`, `--validate-rtol`) and which of
its answers to compare (`--validate-fraction`: the others are sent and counted without being decoded, so
checking costs the drive rate only that share). An answer that differs counts as an error of kind
`mismatch`, one that does not decode as `bad_response`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from client.errors import PerfClientError
from client.inputs import from_samples, sample_slices
from client.protocol import ModelMeta
from common.arrays import fitted
from common.datatypes import numpy_dtype

# The tolerances of `trtbuild verify` (which imports them) and of --validate: the server batches requests differently
# from the local run (dynamic batching, other batch sizes), which may pick other kernels and sum in
# another order, so bit-equality is too strict; a wrong model, variant or input is far outside.
ATOL = 1e-4
RTOL = 1e-3
# The error kind a validated answer that differs from the expected outputs is counted under.
MISMATCH = "mismatch"

FLAG = "--validate"


@dataclass(frozen=True)
class ValidateOptions:
    """How answers are compared: `allclose(got, want, atol, rtol)` on `fraction` of each payload's answers.

    `mix`: the file's samples join the ordinary payloads (`--input-data`) in the rotation instead of
    replacing them, so the server sees the load it is measured under and the checked inputs among it.
    """

    atol: float = ATOL
    rtol: float = RTOL
    fraction: float = 1.0
    mix: bool = False

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        for flag, value in (("--validate-atol", self.atol), ("--validate-rtol", self.rtol)):
            if not value >= 0 or value == float("inf"):
                raise PerfClientError(f"{flag} {value}: expected a finite number >= 0")
        if not 0 < self.fraction <= 1:
            raise PerfClientError(f"--validate-fraction {self.fraction}: expected 0 < F <= 1")


class Check:
    """One payload's expected outputs, and which of its answers are compared (every 1/fraction-th, the
    first one included: deterministic, so two runs check the same requests)."""

    def __init__(self, outputs: Mapping[str, NDArray[Any]], tolerance: ValidateOptions) -> None:
        self.outputs = outputs
        self.tolerance = tolerance
        self._credit = 1.0 - tolerance.fraction  # the first answer is due

    def due(self) -> bool:
        """Whether the next answer to this payload is to be decoded and compared."""
        self._credit += self.tolerance.fraction
        if self._credit >= 1.0 - 1e-9:
            self._credit -= 1.0
            return True
        return False

    def matches(self, got: Mapping[str, NDArray[Any]]) -> bool:
        return outputs_match(got, self.outputs, atol=self.tolerance.atol, rtol=self.tolerance.rtol)


@dataclass(frozen=True)
class Expected:
    """One model's part of a `--validate` file: the samples to send and the outputs they must give."""

    inputs: Mapping[str, NDArray[Any]]
    outputs: Mapping[str, NDArray[Any]]


def load_expected(path: Path, models: Sequence[str]) -> dict[str, Expected]:
    """Every model's inputs and expected outputs from `path`; PerfClientError naming --validate otherwise."""
    if not path.is_file():
        raise PerfClientError(f"{FLAG} {path}: file not found")
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except (OSError, ValueError) as exc:  # not a zip, a truncated one, or object arrays (pickles)
        raise PerfClientError(f"{FLAG} {path}: not a readable .npz ({exc})") from exc
    found = {}
    for model in models:
        parts: dict[str, dict[str, NDArray[Any]]] = {"input": {}, "output": {}}
        for key, array in arrays.items():
            owner, _, rest = key.partition("/")
            kind, _, name = rest.partition("/")
            if owner == model and kind in parts and name:
                parts[kind][name] = array
        if not parts["input"] or not parts["output"]:
            held = sorted({key.partition("/")[0] for key in arrays})
            raise PerfClientError(f"{FLAG} {path}: no {model}/input/* and {model}/output/* arrays "
                                  f"(it holds models: {', '.join(held) or 'none'}); "
                                  "write it with trtbuild verify --save")
        found[model] = Expected(parts["input"], parts["output"])
    return found


def validated_payloads(meta: ModelMeta, batch: int, expected: Expected,
                       source: str) -> list[tuple[dict[str, NDArray[Any]], dict[str, NDArray[Any]]]]:
    """(inputs, expected outputs) per payload: the same sample slices of both, checked against the model."""
    payloads = from_samples(meta, batch, expected.inputs, source, flag=FLAG)
    names = sorted(t.name for t in meta.outputs)
    if sorted(expected.outputs) != names:
        raise PerfClientError(f"{FLAG} {source}: holds outputs {sorted(expected.outputs)}, model {meta.name} "
                              f"returns {names}")
    count = min(len(v) for v in expected.inputs.values())
    for tensor in meta.outputs:
        array = expected.outputs[tensor.name]
        try:
            dtype = numpy_dtype(tensor.datatype)
        except KeyError:
            raise PerfClientError(f"{FLAG} {source}: output {tensor.name!r} of {meta.name} is {tensor.datatype}, "
                                  "which cannot be compared") from None
        if array.dtype != dtype:
            raise PerfClientError(f"{FLAG} {source}: output {tensor.name!r} is {array.dtype}, "
                                  f"model returns {tensor.datatype}")
        sample_shape = array.shape[1:]
        if len(array) < count or len(sample_shape) != len(tensor.shape) or any(
            d != -1 and d != s for d, s in zip(tensor.shape, sample_shape, strict=True)
        ):
            raise PerfClientError(f"{FLAG} {source}: output {tensor.name!r} is {list(array.shape)}, expected "
                                  f"{count} samples of {list(tensor.shape)}")
    slices = sample_slices(meta, batch, count)
    return [(inputs, {name: np.ascontiguousarray(array[part]) for name, array in expected.outputs.items()})
            for inputs, part in zip(payloads, slices, strict=True)]


def outputs_match(got: Mapping[str, NDArray[Any]], expected: Mapping[str, NDArray[Any]], *,
                  atol: float = ATOL, rtol: float = RTOL) -> bool:
    """Every expected output present, of the same shape (a shorter data-sized one padded with zeros, as the
    expected file holds it), and allclose (atol, rtol)."""
    for name, want in expected.items():
        have = got.get(name)
        have = None if have is None else fitted(have, want)
        if have is None or not np.allclose(have, want, atol=atol, rtol=rtol):
            return False
    return True
