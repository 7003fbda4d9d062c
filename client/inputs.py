"""Request payloads built from the model's metadata: random, zero, or real data from .npz / a folder."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from client.errors import PerfClientError
from client.protocol import ModelMeta
from common.choices import Choice
from common.datatypes import numpy_dtype

# Distinct payloads rotated through, so a cache or a branch predictor never sees one request only.
_PAYLOADS = 8


class InputKind(Choice):
    RANDOM = "random"
    ZERO = "zero"
    NPZ = "npz"  # one .npz archive keyed by input name, samples on axis 0
    FOLDER = "folder"  # a folder of NAME.npy files


@dataclass(frozen=True)
class InputData:
    """Where request tensors come from: generated (random, zero) or real samples at `path`."""

    kind: InputKind = InputKind.RANDOM
    path: Path | None = None

    def __post_init__(self) -> None:
        if (self.path is None) != (self.kind in (InputKind.RANDOM, InputKind.ZERO)):
            raise PerfClientError(f"--input-data: {self.kind} {'needs' if self.path is None else 'takes no'} path")

    @classmethod
    def parse(cls, value: str) -> InputData:
        """`--input-data`: random | zero | FILE.npz | a folder of NAME.npy."""
        if value in (InputKind.RANDOM.value, InputKind.ZERO.value):
            return cls(InputKind(value))
        path = Path(value)
        if path.suffix == ".npz":
            return cls(InputKind.NPZ, path)  # a missing file is reported when it is read
        if path.is_dir():
            return cls(InputKind.FOLDER, path)
        raise PerfClientError(f"--input-data {value!r}: expected random, zero, a .npz file or a folder of .npy files")

    def __str__(self) -> str:
        return str(self.path) if self.path is not None else str(self.kind)


def parse_shapes(values: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """`--shape NAME:D1,D2` values (without the batch dim) as {name: dims}."""
    shapes = {}
    for value in values:
        name, sep, dims = value.partition(":")
        try:
            parsed = tuple(int(d) for d in dims.split(",")) if dims else ()
        except ValueError:
            parsed = ()
        if not sep or not name or not parsed or min(parsed) < 1:
            raise PerfClientError(f"--shape {value!r}: expected NAME:D1,D2,... with positive integers")
        shapes[name] = parsed
    return shapes


def _resolve_shape(meta: ModelMeta, name: str, shape: tuple[int, ...],
                   overrides: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    if name in overrides:
        given = overrides[name]
        if len(given) != len(shape) or any(d != -1 and d != g for d, g in zip(shape, given, strict=True)):
            raise PerfClientError(f"--shape {name}:{','.join(map(str, given))}: model {meta.name} expects "
                                  f"{list(shape)} (-1 is free)")
        return given
    if any(d < 0 for d in shape):
        raise PerfClientError(f"input {name!r} of {meta.name} has dynamic dims {list(shape)}; "
                              f"expected --shape {name}:DIMS")
    return shape


def build_payloads(meta: ModelMeta, batch: int, source: InputData, overrides: Mapping[str, tuple[int, ...]],
                   seed: int | np.random.SeedSequence = 0) -> list[dict[str, NDArray[Any]]]:
    """Up to 8 distinct payloads of `batch` samples each (random ones drawn from `seed`)."""
    if batch < 1:
        raise PerfClientError(f"-b {batch}: expected a positive batch size")
    if meta.max_batch_size == 0 and batch != 1:
        raise PerfClientError(f"-b {batch}: model {meta.name} does not batch (max_batch_size 0); expected -b 1")
    if meta.max_batch_size and batch > meta.max_batch_size:
        raise PerfClientError(f"-b {batch}: model {meta.name} accepts at most {meta.max_batch_size}")
    unknown = sorted(set(overrides) - {t.name for t in meta.inputs})
    if unknown:
        raise PerfClientError(f"--shape {', '.join(unknown)}: not inputs of {meta.name} "
                              f"(inputs: {', '.join(t.name for t in meta.inputs)})")
    if source.kind in (InputKind.RANDOM, InputKind.ZERO):
        return _synthetic(meta, batch, source.kind, overrides, seed)
    return from_samples(meta, batch, _load(source), str(source))


def _load(source: InputData) -> dict[str, NDArray[Any]]:
    path = source.path
    assert path is not None  # InputData guarantees a path for the file kinds
    if source.kind is InputKind.NPZ:
        if not path.is_file():
            raise PerfClientError(f"--input-data {path}: file not found")
        with np.load(path, allow_pickle=False) as archive:
            return {k: archive[k] for k in archive.files}
    if not path.is_dir():
        raise PerfClientError(f"--input-data {path}: folder not found")
    return {p.stem: np.load(p, allow_pickle=False) for p in sorted(path.glob("*.npy"))}


def _dtype(meta: ModelMeta, name: str, datatype: str) -> np.dtype[Any]:
    try:
        return numpy_dtype(datatype)
    except KeyError:
        raise PerfClientError(f"input {name!r} of {meta.name}: datatype {datatype} is not supported") from None


def _synthetic(meta: ModelMeta, batch: int, kind: InputKind, overrides: Mapping[str, tuple[int, ...]],
               seed: int | np.random.SeedSequence) -> list[dict[str, NDArray[Any]]]:
    rng = np.random.default_rng(seed)
    payloads = []
    for _ in range(1 if kind is InputKind.ZERO else _PAYLOADS):
        payload = {}
        for tensor in meta.inputs:
            dtype = _dtype(meta, tensor.name, tensor.datatype)
            shape = _resolve_shape(meta, tensor.name, tensor.shape, overrides)
            full = ((batch,) if meta.max_batch_size else ()) + shape
            if kind is InputKind.ZERO:
                array = np.zeros(full, dtype=dtype)
            elif np.issubdtype(dtype, np.floating):
                array = rng.standard_normal(full).astype(dtype)
            elif dtype == np.bool_:
                array = rng.random(full) < 0.5
            else:
                # Small non-negative integers are valid token ids, masks and class indices alike.
                array = rng.integers(0, 2, size=full).astype(dtype)
            payload[tensor.name] = array
        payloads.append(payload)
    return payloads


def sample_slices(meta: ModelMeta, batch: int, count: int) -> list[slice | int]:
    """Which samples each payload holds, up to 8 payloads: consecutive runs of `batch` from the start
    (one sample index each when the model does not batch). `--validate` slices expected outputs alike."""
    slices: list[slice | int] = []
    for start in range(0, max(count - batch + 1, 1), batch):
        slices.append(slice(start, start + batch) if meta.max_batch_size else start)
        if len(slices) >= _PAYLOADS:
            break
    return slices


def from_samples(meta: ModelMeta, batch: int, data: Mapping[str, NDArray[Any]], source: str,
                 flag: str = "--input-data") -> list[dict[str, NDArray[Any]]]:
    """Payloads cut from real samples (leading sample axis), checked against the model's inputs;
    errors name `flag` and `source`."""
    names = [t.name for t in meta.inputs]
    if sorted(data) != sorted(names):
        raise PerfClientError(f"{flag} {source}: holds {sorted(data)}, model {meta.name} expects {sorted(names)}")
    count = min(len(v) for v in data.values())
    payloads = []
    for part in sample_slices(meta, batch, count):
        payload = {}
        for tensor in meta.inputs:
            array = data[tensor.name]
            if array.dtype != _dtype(meta, tensor.name, tensor.datatype):
                raise PerfClientError(f"{flag} {source}: {tensor.name!r} is {array.dtype}, "
                                      f"model expects {tensor.datatype}")
            chunk = array[part]
            if meta.max_batch_size and len(chunk) < batch:
                raise PerfClientError(f"{flag} {source}: {tensor.name!r} has {len(array)} samples, "
                                      f"fewer than -b {batch}")
            sample_shape = chunk.shape[1:] if meta.max_batch_size else chunk.shape
            if sample_shape == () and tuple(tensor.shape) in ((1,), (-1,)):
                # A scalar sample (a VAD's sample rate, saved 0-d per sample) for an input Triton declares [1]:
                # the builder serves an ONNX scalar so (dims [1], reshape to []); the same one value is sent.
                chunk = np.asarray(chunk).reshape((*chunk.shape, 1))
                sample_shape = (1,)
            if len(sample_shape) != len(tensor.shape) or any(
                d != -1 and d != s for d, s in zip(tensor.shape, sample_shape, strict=True)
            ):
                raise PerfClientError(f"{flag} {source}: {tensor.name!r} samples are {list(sample_shape)}, "
                                      f"model expects {list(tensor.shape)}")
            payload[tensor.name] = np.ascontiguousarray(chunk)
        payloads.append(payload)
    return payloads
