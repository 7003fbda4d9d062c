"""Send real held-out inputs to the running server over gRPC and HTTP and compare each answer with
ONNX Runtime running the same artifact locally."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from builder.errors import BuilderError, ServerError
from builder.repository.model_folder import read_record
from builder.runtimes import select
from builder.spec.enums import RuntimeChoice
from builder.spec.model import ModelSpec
from builder.spec.names import variant_name
from builder.steps import samples as samples_mod
from client.datatypes import triton_datatype
from client.protocol import Protocol

log = logging.getLogger(__name__)

# The server batches requests differently from the local run, which may pick other kernels.
ATOL = 1e-4
RTOL = 1e-3


@dataclass(frozen=True)
class VerifyResult:
    variant: str
    protocol: Protocol
    samples: int
    max_abs_diff: float
    ok: bool


def _infer(
    protocol: Protocol, url: str, model: str, feed: dict[str, NDArray[Any]], outputs: list[str]
) -> dict[str, NDArray[Any]]:
    client: Any
    if protocol is Protocol.GRPC:
        import tritonclient.grpc as tc
    else:
        import tritonclient.http as tc
    client = tc.InferenceServerClient(url=url)
    try:
        inputs = []
        for name, array in feed.items():
            item = tc.InferInput(name, list(array.shape), triton_datatype(array.dtype))
            item.set_data_from_numpy(array)
            inputs.append(item)
        requested = [tc.InferRequestedOutput(n) for n in outputs]
        result = client.infer(model, inputs, outputs=requested)
        return {n: result.as_numpy(n) for n in outputs}
    except Exception as exc:
        raise ServerError(f"{model}: {protocol} request to {url} failed: {str(exc).strip()[:200]}") from exc
    finally:
        client.close()


def verify_variant(repository: Path, name: str, samples: dict[str, NDArray[Any]], urls: Mapping[Protocol, str],
                   batch: int = 4) -> list[VerifyResult]:
    record = read_record(repository / name)
    if record is None:
        raise BuilderError(f"{repository / name}: no build record; run `make engines` first")
    # The artifact runs locally under the runtime that built it (a TensorRT plan needs TensorRT here).
    runtime = select(RuntimeChoice.parse(record.runtime, f"{repository / name}: build record runtime",
                                         error=BuilderError))
    expected = runtime.run(repository / record.artifact, samples, batch)
    outputs = list(expected)
    count = len(next(iter(samples.values())))
    results = []
    for protocol, url in urls.items():
        worst = 0.0
        ok = True
        for start in range(0, count, batch):
            feed = {k: np.ascontiguousarray(v[start : start + batch]) for k, v in samples.items()}
            got = _infer(protocol, url, name, feed, outputs)
            for out in outputs:
                want = expected[out][start : start + batch]
                worst = max(worst, float(np.max(np.abs(got[out].astype(np.float64) - want))))
                ok = ok and bool(np.allclose(got[out], want, atol=ATOL, rtol=RTOL))
        results.append(VerifyResult(name, protocol, count, worst, ok))
    return results


def verify_models(
    specs: list[ModelSpec], repository: Path, urls: Mapping[Protocol, str], samples: int = 16
) -> list[VerifyResult]:
    results: list[VerifyResult] = []
    for spec in specs:
        if spec.evaluation is None:
            log.info("%s: no evaluation data in the manifest; skipped", spec.name)
            continue
        held_out = samples_mod.load(spec.evaluation, f"model {spec.name!r}: evaluation")
        held_out = samples_mod.take(held_out, 0, samples)
        for prec in spec.precisions:
            results.extend(verify_variant(repository, variant_name(spec.name, prec), held_out, urls))
    return results
