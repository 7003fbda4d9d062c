"""Calibration and evaluation samples: loading, checking against the model's inputs, hashing."""

from __future__ import annotations

import hashlib
import importlib
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from builder.errors import DataError, ManifestError
from builder.spec.model import DataSpec, DimRange, TensorSpec

Samples = dict[str, NDArray[Any]]
SampleFn = Callable[[int, int], Samples]


def resolve(ref: str, what: str) -> Callable[..., object]:
    """Import `module:function`; errors name the reference."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise ManifestError(f"{what}: {ref!r} is not of the form module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ManifestError(f"{what}: cannot import module {module_name!r} ({exc})") from exc
    func = getattr(module, attr, None)
    if not callable(func):
        raise ManifestError(f"{what}: {module_name!r} has no callable {attr!r}")
    return func  # type: ignore[no-any-return]


def load_npz(path: Path, what: str) -> Samples:
    if not path.is_file():
        raise DataError(f"{what}: {path}: file not found")
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {key: archive[key] for key in archive.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise DataError(f"{what}: {path}: not a readable .npz archive ({exc})") from exc


def load(spec: DataSpec, what: str) -> Samples:
    """Samples from a `.npz` (keyed by input name, leading sample axis) or a `module:function`."""
    if spec.is_file:
        samples = load_npz(Path(spec.source), what)
        count = min(len(a) for a in samples.values()) if samples else 0
        if count > spec.samples:
            samples = {k: v[: spec.samples] for k, v in samples.items()}
        return samples
    func = resolve(spec.source, what)
    result = func(spec.samples, spec.seed)
    if not isinstance(result, Mapping):
        raise DataError(f"{what}: {spec.source} returned {type(result).__name__}, expected a dict of arrays")
    return {str(k): np.asarray(v) for k, v in result.items()}


def validate(
    samples: Mapping[str, NDArray[Any]],
    inputs: tuple[TensorSpec, ...],
    dims: Mapping[str, DimRange],
    what: str,
) -> int:
    """Check names, dtypes and shapes against the model's inputs; return the sample count."""
    expected = [t.name for t in inputs]
    missing = [n for n in expected if n not in samples]
    extra = sorted(set(samples) - set(expected))
    if missing or extra:
        raise DataError(
            f"{what}: input names {sorted(samples)} do not match the model's {expected}"
            + (f" (missing {missing})" if missing else "")
            + (f" (unexpected {extra})" if extra else "")
        )
    counts = set()
    for tensor in inputs:
        array = samples[tensor.name]
        if array.dtype != np.dtype(tensor.dtype):
            raise DataError(f"{what}: input {tensor.name!r} has dtype {array.dtype}, expected {tensor.dtype}")
        want = (-1, *tensor.sample_shape)
        if array.ndim != len(want):
            raise DataError(
                f"{what}: input {tensor.name!r} has shape {list(array.shape)}, expected "
                f"[samples, {', '.join(str(d) for d in want[1:])}]"
            )
        for axis, (have, dim) in enumerate(zip(array.shape[1:], want[1:], strict=True), start=1):
            if isinstance(dim, int) and have != dim:
                raise DataError(
                    f"{what}: input {tensor.name!r} axis {axis} is {have}, expected {dim} "
                    f"(shape {list(array.shape)})"
                )
            if isinstance(dim, str):
                rng = dims[dim]
                if not rng.min <= have <= rng.max:
                    raise DataError(
                        f"{what}: input {tensor.name!r} axis {axis} ({dim}) is {have}, "
                        f"expected {rng.min}..{rng.max}"
                    )
        counts.add(array.shape[0])
    if len(counts) != 1 or 0 in counts:
        raise DataError(f"{what}: every input needs the same, non-zero number of samples; got {sorted(counts)}")
    return counts.pop()


def digest(samples: Mapping[str, NDArray[Any]]) -> str:
    """A content hash of the samples, stable across runs (names, dtypes, shapes, bytes)."""
    h = hashlib.sha256()
    for name in sorted(samples):
        array = np.ascontiguousarray(samples[name])
        h.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
        h.update(array.tobytes())
    return h.hexdigest()


def take(samples: Mapping[str, NDArray[Any]], start: int, stop: int) -> Samples:
    return {k: v[start:stop] for k, v in samples.items()}


def hold_out(calibration: Samples) -> tuple[Samples, Samples]:
    """(calibration, held out): the last quarter of the samples is kept for the accuracy check and
    never calibrated on. The build and verify both split this way."""
    count = len(next(iter(calibration.values())))
    cut = count - count // 4
    return take(calibration, 0, cut), take(calibration, cut, count)


def random_samples(inputs: tuple[TensorSpec, ...], dims: Mapping[str, DimRange], count: int, seed: int, *,
                   integers: bool = False) -> Samples:
    """Synthetic inputs at the opt size of dynamic dims. Floats only, unless `integers`: then integer
    inputs get 0s and 1s (valid token ids, masks and class indices alike) — enough to compare two
    runs of one model, meaningless as an accuracy reference."""
    rng = np.random.default_rng(seed)
    out: Samples = {}
    for tensor in inputs:
        shape = [count, *(dims[d].opt if isinstance(d, str) else d for d in tensor.sample_shape)]
        dtype = np.dtype(tensor.dtype)
        if np.issubdtype(dtype, np.floating):
            out[tensor.name] = rng.standard_normal(shape).astype(dtype)
        elif integers:
            out[tensor.name] = rng.integers(0, 2, size=shape).astype(dtype)
        else:
            raise DataError(
                f"input {tensor.name!r} is {tensor.dtype}: random data would be meaningless; "
                "expected evaluation data (--eval-data FILE.npz)"
            )
    return out
