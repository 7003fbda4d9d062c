"""Send real held-out inputs to the running server over gRPC and HTTP and compare each answer with
the same artifact run locally under the runtime that built it.

`expected_archive` turns what was sent and expected into the arrays of one .npz
(`<variant>/input/<name>`, `<variant>/output/<name>`, leading sample axis) that
`perfclient --validate` reads; the CLI writes it.
"""

from __future__ import annotations

import io
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray
from tritonclient.utils import InferenceServerException

from builder.errors import BuilderError, ServerError
from builder.repository import onnx_files
from builder.repository.model_folder import RECORD, read_record
from builder.runtimes import select
from builder.runtimes.base import feeds as sample_feeds
from builder.spec.enums import Precision, RuntimeChoice, Task
from builder.spec.model import CalibrationSpec, DataSpec, DimRange, ModelSpec, TensorSpec
from builder.spec.names import variant_name
from builder.spec.shapes import ModelShapes, ValueRange, for_model
from builder.steps import onnx_model
from builder.steps import samples as samples_mod
from client.admin_key import key_header
from client.protocol import Protocol
from client.validate import ATOL, RTOL  # one pair of tolerances for verify and perfclient --validate
from common import progress
from common.arrays import fitted
from common.datatypes import triton_datatype

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 60.0  # one verify request; a server that takes longer is stuck


@dataclass(frozen=True)
class VerifyResult:
    variant: str
    protocol: Protocol
    samples: int
    max_abs_diff: float
    ok: bool
    source: str = "held-out"  # what the samples are: held-out, held-out calibration, synthetic


@dataclass(frozen=True)
class VariantCheck:
    """One variant's verification: the answers per protocol, the samples sent and the outputs expected."""

    variant: str
    results: tuple[VerifyResult, ...]
    inputs: Mapping[str, NDArray[Any]]
    expected: Mapping[str, NDArray[Any]]


class _Client:
    """One tritonclient client of one protocol, for every request of a variant (a client per request costs a
    connection each, and with gRPC a channel); closed on leaving the `with` block."""

    def __init__(self, protocol: Protocol, url: str, key: str | None = None) -> None:
        self.protocol, self.url = protocol, url
        self.client: Any
        self.options: dict[str, Any]
        if protocol is Protocol.GRPC:
            import tritonclient.grpc as grpc_tc

            self.tc: Any = grpc_tc
            self.client = grpc_tc.InferenceServerClient(url=url)
            self.options = {"client_timeout": REQUEST_TIMEOUT_S}
        else:
            import tritonclient.http as http_tc

            self.tc = http_tc
            self.client = http_tc.InferenceServerClient(url=url, connection_timeout=REQUEST_TIMEOUT_S,
                                                        network_timeout=REQUEST_TIMEOUT_S)
            self.options = {}
        if key:  # a server whose restricted APIs need the admin key (client.admin_key)
            self.options["headers"] = {key_header(str(protocol)): key}

    def __enter__(self) -> _Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()

    def infer(self, model: str, feed: dict[str, NDArray[Any]], outputs: list[str]) -> dict[str, NDArray[Any]]:
        inputs = []
        for name, array in feed.items():
            array = array.reshape(1) if array.ndim == 0 else array  # config.pbtxt declares a scalar [1]
            item = self.tc.InferInput(name, list(array.shape), triton_datatype(array.dtype))
            item.set_data_from_numpy(array)
            inputs.append(item)
        requested = [self.tc.InferRequestedOutput(n) for n in outputs]
        try:
            result = self.client.infer(model, inputs, outputs=requested, **self.options)
            return {n: result.as_numpy(n) for n in outputs}
        except (InferenceServerException, OSError) as exc:  # the server's answer, or no connection
            raise ServerError(f"{model}: {self.protocol} request to {self.url} failed: {str(exc).strip()[:200]}"
                              ) from exc


def check_variant(repository: Path, name: str, samples: dict[str, NDArray[Any]], urls: Mapping[Protocol, str],
                  batch: int = 4, source: str = "held-out", *, key: str | None = None) -> VariantCheck:
    record = read_record(repository / name)
    if record is None:
        raise BuilderError(f"{repository / name}: no build record; run `make engines` first")
    # The artifact runs locally under the runtime that built it (a TensorRT plan needs TensorRT here).
    runtime = select(RuntimeChoice.parse(record.runtime, f"{repository / name}: build record runtime",
                                         error=BuilderError))
    # A model built with max_batch_size 0 takes each sample whole (batch None).
    step = batch if record.shapes is None or record.shapes.batching else None
    expected = runtime.run(repository / record.artifact, samples, step)
    outputs = list(expected)
    count = len(next(iter(samples.values())))
    results = []
    for protocol, url in urls.items():
        worst = 0.0
        ok = True
        with _Client(protocol, url, key) as client:
            for index, feed in enumerate(sample_feeds(samples, step)):
                got = client.infer(name, {k: np.ascontiguousarray(v) for k, v in feed.items()}, outputs)
                for out in outputs:
                    want = expected[out][index * batch : (index + 1) * batch] if step else expected[out][index]
                    have = fitted(got[out], want, batched=step is not None)
                    if have is None:
                        log.warning("%s: output %r over %s is %s, expected %s", name, out, protocol,
                                    list(got[out].shape), list(want.shape))
                        worst, ok = math.inf, False
                        continue
                    worst = max(worst, float(np.max(np.abs(have.astype(np.float64) - want), initial=0.0)))
                    ok = ok and bool(np.allclose(have, want, atol=ATOL, rtol=RTOL))
        results.append(VerifyResult(name, protocol, count, worst, ok, source))
    return VariantCheck(name, tuple(results), dict(samples), dict(expected))


def verify_variant(repository: Path, name: str, samples: dict[str, NDArray[Any]], urls: Mapping[Protocol, str],
                   batch: int = 4, source: str = "held-out") -> list[VerifyResult]:
    return list(check_variant(repository, name, samples, urls, batch, source).results)


def expected_archive(checks: Sequence[VariantCheck]) -> dict[str, NDArray[Any]]:
    """The arrays of a `--save` file: `<variant>/input/<name>` and `<variant>/output/<name>`, samples on axis 0."""
    arrays: dict[str, NDArray[Any]] = {}
    for check in checks:
        for kind, tensors in (("input", check.inputs), ("output", check.expected)):
            for tensor, array in tensors.items():
                arrays[f"{check.variant}/{kind}/{tensor}"] = np.ascontiguousarray(array)
    return arrays


def npz_bytes(arrays: Mapping[str, NDArray[Any]]) -> bytes:
    """An uncompressed .npz of `arrays` in memory, for an atomic write."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def specs_from_records(repository: Path) -> list[ModelSpec]:
    """Every model in `repository` as its variants' build.json describe it (for `trtbuild verify` without a
    models.toml: a `build --onnx` model): its variants, shapes, and where its samples came from."""
    records: dict[str, dict[str, Any]] = {}
    made: dict[str, set[Precision]] = {}
    for path in sorted(repository.glob(f"*/{RECORD}")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            name, prec = data["model"], Precision(data["precision"])
        except (OSError, ValueError, KeyError, TypeError):  # not a record of ours (or an older one)
            continue
        if not isinstance(name, str) or path.parent.name != variant_name(name, prec):
            continue
        records.setdefault(name, data)
        made.setdefault(name, set()).add(prec)
    specs = []
    for name, data in records.items():
        shapes = ModelShapes.from_json(data["shapes"]) if data.get("shapes") else None
        found = data.get("samples") or {}

        def data_spec(entry: Any) -> DataSpec | None:
            return DataSpec(str(entry["source"]), int(entry["samples"]), int(entry.get("seed", 0))) if entry else None

        evaluation, calibration = data_spec(found.get("evaluation")), data_spec(found.get("calibration"))
        specs.append(ModelSpec(
            name=name, batch=(shapes.batch if shapes is not None else None) or DimRange(1, 1, 1), batch_given=False,
            precisions=tuple(p for p in Precision if p in made[name]),
            task=Task.parse(found.get("task", Task.GENERIC.value), f"{name}: build.json task", error=BuilderError),
            evaluation=evaluation, calibration=CalibrationSpec(calibration) if calibration is not None else None,
            shapes=dict(shapes.inputs) if shapes is not None else {},
            no_batch=shapes is not None and not shapes.batching,
            input_ranges={k: ValueRange(int(lo), int(hi)) for k, (lo, hi) in found.get("input_ranges", {}).items()},
        ))
    return specs


def _signature_inputs(spec: ModelSpec, repository: Path) -> tuple[TensorSpec, ...]:
    """The model's inputs: declared in models.toml, else read from a variant ONNX in the repository."""
    if spec.inputs:
        return spec.inputs
    for prec in spec.precisions:
        record = read_record(repository / variant_name(spec.name, prec))
        if record is not None and record.artifact.endswith(".onnx"):
            what = f"model {spec.name!r}"
            return onnx_model.signature(onnx_files.load(repository / record.artifact), what).inputs
    raise BuilderError(f"model {spec.name!r}: no evaluation data, no declared inputs and no ONNX artifact in "
                       f"{repository} to make synthetic samples from; expected [model.evaluation] in the manifest")


def verification_samples(spec: ModelSpec, repository: Path, count: int) -> tuple[samples_mod.Samples, str]:
    """What to send: the held-out evaluation data; else the held-out quarter of the calibration data (as
    the build did); else synthetic samples at the opt shape. The second value says which."""
    what = f"model {spec.name!r}"
    if spec.evaluation is not None:
        return samples_mod.take(samples_mod.load(spec.evaluation, f"{what}: evaluation"), 0, count), "held-out"
    if spec.calibration is not None:
        _, held_out = samples_mod.hold_out(samples_mod.load(spec.calibration.data, f"{what}: calibration"))
        return samples_mod.take(held_out, 0, count), "held-out calibration"
    inputs = _signature_inputs(spec, repository)
    shapes = for_model(spec, inputs, what)
    return samples_mod.synthetic(inputs, shapes, count, seed=1, value_ranges=spec.input_ranges,
                                 integers=True), "synthetic (opt shape)"


def check_models(
    specs: list[ModelSpec], repository: Path, urls: Mapping[Protocol, str], samples: int = 16, *,
    key: str | None = None,
) -> list[VariantCheck]:
    checks: list[VariantCheck] = []
    for spec in specs:
        chosen, source = verification_samples(spec, repository, samples)
        if source != "held-out":  # the table's samples column says which
            log.debug("%s: no evaluation data in the manifest; verifying with %s samples", spec.name, source)
        with progress.task(f"verify {spec.name}", total=len(spec.precisions)) as bar:
            for prec in spec.precisions:
                name = variant_name(spec.name, prec)
                checks.append(check_variant(repository, name, chosen, urls, source=source, key=key))
                bar.advance(status=name)
    return checks


def verify_models(
    specs: list[ModelSpec], repository: Path, urls: Mapping[Protocol, str], samples: int = 16
) -> list[VerifyResult]:
    return [r for check in check_models(specs, repository, urls, samples) for r in check.results]


def table_lines(checks: Sequence[VariantCheck]) -> list[str]:
    """A title, then one row per variant and one column per protocol: OK or MISMATCH with the largest
    difference from the same artifact run locally."""
    protocols = list(dict.fromkeys(r.protocol for check in checks for r in check.results))
    width = max([len("variant"), *(len(c.variant) for c in checks)])
    samples = {c.variant: f"{c.results[0].samples} {c.results[0].source}" if c.results else "-" for c in checks}
    swidth = max([len("samples"), *(len(s) for s in samples.values())])
    lines = ["verify: the server's answers against the same artifact run here (max |difference|)",
             f"{'variant':<{width}}  {'samples':<{swidth}}  " + "  ".join(f"{p!s:<18}" for p in protocols).rstrip()]
    for check in checks:
        by_protocol = {r.protocol: r for r in check.results}
        cells = []
        for protocol in protocols:
            r = by_protocol.get(protocol)
            cell = "-" if r is None else f"{'OK' if r.ok else 'MISMATCH'} {r.max_abs_diff:.1e}"
            cells.append(f"{cell:<18}")
        lines.append(f"{check.variant:<{width}}  {samples[check.variant]:<{swidth}}  " + "  ".join(cells).rstrip())
    return lines
