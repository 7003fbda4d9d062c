"""The seams between the build pipeline and whatever executes a graph.

A runtime turns a precision variant's ONNX into the artifact Triton serves, runs that artifact for
the accuracy check, and says how Triton must serve it. Everything runtime-specific (options,
staleness, artifacts carried over from earlier builds, backend settings) stays behind it.

A reference executor runs ONNX graphs in this process for the steps: the FP32 reference every variant is
compared with, and the candidate graphs the clean-up and the guards try, whatever runtime serves the variants.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from builder.errors import OnnxModelError
from builder.repository.triton_config import BackendConfig
from builder.spec.model import DimRange, TensorSpec
from builder.spec.shapes import ModelShapes, resolve

log = logging.getLogger(__name__)


class OutputShapeError(OnnxModelError):
    """A model's outputs cannot be put together over its samples (the message names the output)."""


Outputs = dict[str, NDArray[Any]]


def feeds(samples: Mapping[str, NDArray[Any]], batch_size: int | None) -> Iterator[dict[str, NDArray[Any]]]:
    """What to run, in order: slices of `batch_size` samples; or, for a model that does not batch
    (`batch_size` None), each sample alone, whole (its leading index dropped)."""
    count = len(next(iter(samples.values())))
    if batch_size is None:
        for index in range(count):
            # np.require keeps a scalar input 0-d (np.ascontiguousarray would make it [1]).
            yield {k: np.require(np.asarray(v[index]), requirements="C") for k, v in samples.items()}
        return
    for start in range(0, count, batch_size):
        yield {k: v[start : start + batch_size] for k, v in samples.items()}


def join(parts: Mapping[str, list[NDArray[Any]]], batch_size: int | None) -> dict[str, NDArray[Any]]:
    """The outputs of `feeds` put back together: concatenated batches, or stacked whole samples. Where an output's
    size depends on the data (a TTS model's audio grows with its text), the chunks are padded with zeros to the
    largest: the comparisons then score each sample on its own values (zeros add nothing to a cosine) and a variant
    that returns another length differs where the lengths do."""
    if batch_size is None:
        return {n: np.stack(_padded(n, chunks, 0)) for n, chunks in parts.items()}
    return {n: np.concatenate(_padded(n, chunks, 1)) for n, chunks in parts.items()}


def _padded(name: str, chunks: list[NDArray[Any]], first: int) -> list[NDArray[Any]]:
    """`chunks` with their dims from `first` on padded to the largest (all unchanged where they agree)."""
    shapes = {chunk.shape[first:] for chunk in chunks}
    if len(shapes) <= 1:
        return chunks
    ranks = {len(shape) for shape in shapes}
    if len(ranks) > 1:
        raise OutputShapeError(f"output {name!r} has a different rank per sample ({sorted(shapes)}): expected one "
                               "rank for every sample")
    largest = tuple(max(dims) for dims in zip(*shapes, strict=True))
    log.debug("output %r: sizes differ per sample (%s); padded with zeros to %s", name, sorted(shapes), largest)
    return [np.pad(chunk, [(0, 0)] * first + [(0, want - have) for have, want in zip(chunk.shape[first:], largest,
                                                                                    strict=True)])
            for chunk in chunks]


@dataclass(frozen=True)
class CompileTarget:
    """What a runtime needs to know about the model to compile one variant."""

    inputs: tuple[TensorSpec, ...]
    batch: DimRange
    dims: Mapping[str, DimRange]
    onnx_sha256: str  # of the variant ONNX: what a compiled artifact was built from
    shapes: ModelShapes | None = None  # every input's shape range; None: from inputs, batch and dims

    def model_shapes(self) -> ModelShapes:
        if self.shapes is not None:
            return self.shapes
        return resolve(self.inputs, batch=self.batch, dims=self.dims, shapes={}, what="compile target")


class Runtime(Protocol):
    name: str
    artifact: str  # file name inside the Triton model version folder

    def identity(self) -> dict[str, str]:
        """Everything about this machine's runtime that a built artifact depends on."""
        ...

    def carry_over(self, previous: Path, version_dir: Path, target: CompileTarget) -> None:
        """Copy artifacts from the previous build of this variant that stay valid (or do nothing)."""
        ...

    def compile(self, onnx_path: Path, out_path: Path, target: CompileTarget) -> None: ...

    def run(self, artifact: Path, samples: Mapping[str, NDArray[Any]], batch_size: int | None) -> Outputs:
        """Outputs for every sample; `batch_size` None: the model does not batch, run each sample whole."""
        ...

    def backend_config(self, target: CompileTarget, version_dir: Path) -> BackendConfig:
        """How Triton serves the artifact compiled into version_dir."""
        ...

    def served_options(self, artifact: Path) -> dict[str, str]:
        """The options this artifact runs with where they depend on the artifact itself (build.json keeps
        them beside `identity()`); empty where nothing does."""
        ...


class ReferenceExecutor(Protocol):
    """Runs an ONNX file in this process: the FP32 reference and the candidates the steps compare with it."""

    name: str
    # What it raises for a graph it cannot load or run on the samples given: the user's model (or a tool's
    # output for it), which the steps report in one line, not a bug of ours.
    errors: tuple[type[Exception], ...]

    def run(self, path: Path, samples: Mapping[str, NDArray[Any]], batch_size: int | None) -> Outputs:
        """Outputs for every sample; `batch_size` None: the model does not batch, run each sample whole."""
        ...

    def throughput(self, path: Path, feed: Mapping[str, NDArray[Any]], *, seconds: float = 1.0) -> float:
        """Inferences per second of one feed, repeated for `seconds` (a quick cost estimate)."""
        ...
