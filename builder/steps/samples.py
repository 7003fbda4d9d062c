"""Calibration and evaluation samples: loading, checking against the model's inputs, hashing."""

from __future__ import annotations

import hashlib
import importlib
import math
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from builder.errors import DataError, ManifestError
from builder.spec.model import DataSpec, TensorSpec
from builder.spec.shapes import Level, ModelShapes, ValueRange, format_shape

Samples = dict[str, NDArray[Any]]
# Synthetic samples of one input at most (bytes): far beyond any real model's evaluation set.
SYNTHETIC_LIMIT = 4 * 2**30
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
    shapes: ModelShapes,
    what: str,
) -> int:
    """Check names, dtypes and shapes against the model's inputs; return the sample count. Arrays hold
    one sample per leading index: a batch element for a batching model, a whole input otherwise."""
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
        one = shapes.sample_range(tensor.name)
        wanted = ", ".join(str(lo) if lo == hi else f"{lo}..{hi}" for lo, hi in zip(one.min, one.max, strict=True))
        layout = "one sample per leading index, each a whole input" if not shapes.batching else "samples first"
        if array.ndim != len(one.min) + 1:
            raise DataError(f"{what}: input {tensor.name!r} has shape {list(array.shape)}, expected "
                            f"[samples{', ' if wanted else ''}{wanted}] ({layout})")
        for axis, (have, low, high) in enumerate(zip(array.shape[1:], one.min, one.max, strict=True), start=1):
            if not low <= have <= high:
                raise DataError(f"{what}: input {tensor.name!r} axis {axis} is {have}, expected "
                                f"{low if low == high else f'{low}..{high}'} (shape {list(array.shape)}, "
                                f"expected [samples, {wanted}])")
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


def synthetic(inputs: tuple[TensorSpec, ...], shapes: ModelShapes, count: int, seed: int, *,
              level: Level = Level.OPT, value_ranges: Mapping[str, ValueRange] | None = None,
              integers: bool = False, what: str = "") -> Samples:
    """`count` synthetic samples at one level (min, opt or max) of every input's shape range. Floats are
    standard normal (uniform in a declared range); integer and bool inputs need a declared value range,
    unless `integers`: then they get 0s and 1s (valid token ids, masks and class indices alike) — enough
    to compare two runs of one model, meaningless as an accuracy reference."""
    rng = np.random.default_rng(seed)
    ranges = value_ranges or {}
    prefix = f"{what}: " if what else ""
    out: Samples = {}
    for tensor in inputs:
        shape = [count, *shapes.sample_range(tensor.name).at(level)]
        dtype = np.dtype(tensor.dtype)
        declared = ranges.get(tensor.name)
        if declared is not None and np.issubdtype(dtype, np.integer):
            info = np.iinfo(dtype)
            if declared.low < info.min or declared.high > info.max:
                raise DataError(f"{prefix}--input-range {tensor.name}:{declared.low}:{declared.high}: input "
                                f"{tensor.name!r} is {tensor.dtype}; expected values within {info.min}..{info.max}")
        size = math.prod(shape) * dtype.itemsize
        if size > SYNTHETIC_LIMIT:  # a typo in a shape flag, caught before numpy fills the machine's memory
            raise DataError(f"{prefix}input {tensor.name!r}: {count} synthetic samples at the {level} shape "
                            f"{format_shape(shape[1:])} would take {size / 2**30:.1f} GiB; expected shapes whose "
                            f"samples fit in {SYNTHETIC_LIMIT / 2**30:g} GiB")
        try:
            values = _values(rng, dtype, shape, declared, integers=integers)
        except MemoryError as exc:
            raise DataError(f"{prefix}input {tensor.name!r}: {count} synthetic samples at the {level} shape "
                            f"{format_shape(shape[1:])} do not fit in memory here") from exc
        if values is None:
            raise DataError(
                f"{prefix}input {tensor.name!r} is {tensor.dtype}: random values would be meaningless; expected "
                f"real data (--calibration/--eval-data FILE.npz) or a value range (--input-range "
                f"{tensor.name}:LOW:HIGH, input_ranges.{tensor.name} = [LOW, HIGH] in models.toml)"
            )
        out[tensor.name] = values
    return out


def integers_seen(feed: Samples, examples: Mapping[str, NDArray[Any]] | None,
                  value_ranges: Mapping[str, ValueRange] | None, seed: int) -> Samples:
    """`feed` with each integer input that has no declared range drawn from the values the user's `examples`
    hold for it (a sample rate of 16000, real token ids) instead of synthetic 0s and 1s: a control input such
    as a VAD's `sr` selects an If branch, and 0 or 1 would run a branch the user never feeds."""
    rng = np.random.default_rng(seed)
    out = dict(feed)
    for name, values in feed.items():
        seen = None if examples is None else examples.get(name)
        if name in (value_ranges or {}) or seen is None or not np.issubdtype(values.dtype, np.integer):
            continue
        unique = np.unique(np.asarray(seen))
        if unique.size:
            out[name] = rng.choice(unique, size=values.shape).astype(values.dtype)
    return out


def _values(rng: np.random.Generator, dtype: np.dtype[Any], shape: list[int], declared: ValueRange | None, *,
            integers: bool) -> NDArray[Any] | None:
    """One input's synthetic values; None where none would mean anything (an integer input, no range)."""
    if dtype == np.bool_ and (declared is not None or integers):
        return rng.integers(0, 2, size=shape).astype(dtype)
    if declared is not None and np.issubdtype(dtype, np.floating):
        return rng.uniform(declared.low, declared.high, size=shape).astype(dtype)
    if declared is not None:
        return rng.integers(declared.low, declared.high, size=shape, endpoint=True).astype(dtype)
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(shape).astype(dtype)
    if integers:
        return rng.integers(0, 2, size=shape).astype(dtype)
    return None


def shape_sets(inputs: tuple[TensorSpec, ...], shapes: ModelShapes, count: int, seed: int, *,
               value_ranges: Mapping[str, ValueRange] | None = None,
               integers: bool = False, what: str = "") -> dict[Level, Samples]:
    """Synthetic samples at the min, opt and max shapes (levels with equal shapes given once): what a
    step that runs the graph gets instead of its own guesses (e.g. ModelOpt autocast's
    `calibration_data`, one set per call). For a batching model each set holds `count` batch elements."""
    return {level: synthetic(inputs, shapes, count, seed + i, level=level, value_ranges=value_ranges,
                             integers=integers, what=what)
            for i, level in enumerate(shapes.levels())}


def spatial_axes(sample_shape: tuple[int, ...] | list[int], dtype: str) -> tuple[int, ...]:
    """The axes of one sample that are an image's H and W: a float sample of rank 3, CHW (or HWC where its
    last dim is a small channel count), or of rank 2 (HW). None for anything else (sequences, tokens)."""
    if not np.issubdtype(np.dtype(dtype), np.floating):
        return ()
    if len(sample_shape) == 3:
        return (0, 1) if 0 < sample_shape[-1] <= 4 < sample_shape[0] else (1, 2)
    if len(sample_shape) == 2:
        return (0, 1)
    return ()


def _resize_axis(values: NDArray[Any], axis: int, size: int) -> NDArray[Any]:
    """Linear interpolation along one axis (pixel centres aligned, as image resizers do)."""
    old = values.shape[axis]
    if old == size:
        return values
    pos = np.clip((np.arange(size) + 0.5) * old / size - 0.5, 0, old - 1)
    low = np.floor(pos).astype(np.int64)
    high = np.minimum(low + 1, old - 1)
    weight = (pos - low).reshape([-1 if a == axis else 1 for a in range(values.ndim)])
    out: NDArray[Any] = np.take(values, low, axis=axis) * (1 - weight) + np.take(values, high, axis=axis) * weight
    return out.astype(values.dtype)


def at_shapes(samples: Mapping[str, NDArray[Any]], inputs: tuple[TensorSpec, ...], shapes: Mapping[str, Any],
              count: int, seed: int) -> Samples:
    """`count` of the user's samples brought to other sample shapes (`shapes`: input → shape of one sample):
    an image's H and W resized by linear interpolation; any other dim that differs cropped (to fewer) or tiled
    (to more) along its axis. Crop/tile keeps the data real and consistent across the inputs that share a dim
    (token ids and their attention mask stay paired; random values there gave all-masked sequences whose
    pooled output is noise, and the gate then judged noise). `seed` is kept for callers; nothing is random."""
    del seed
    out: Samples = {}
    for tensor in inputs:
        data = np.asarray(samples[tensor.name])[:count]
        target = tuple(int(d) for d in shapes[tensor.name])
        current = data.shape[1:]
        if current == target:
            out[tensor.name] = data
            continue
        spatial = spatial_axes(current, tensor.dtype)
        changed = [a for a in range(len(target)) if current[a] != target[a]]
        resize = bool(changed) and all(a in spatial for a in changed)
        shaped = data
        for axis in changed:
            shaped = (_resize_axis(shaped, axis + 1, target[axis]) if resize
                      else _crop_or_tile(shaped, axis + 1, target[axis]))
        out[tensor.name] = shaped
    return out


def _crop_or_tile(data: NDArray[Any], axis: int, size: int) -> NDArray[Any]:
    """The first `size` entries along `axis`, the data repeated along it where it holds fewer."""
    length = data.shape[axis]
    if length == 0:
        raise DataError(f"cannot bring samples with an empty axis {axis} to size {size}")
    return np.take(data, np.arange(size) % length, axis=axis)
