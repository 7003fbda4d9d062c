"""Accuracy-guarded INT8: when a quantized variant misses its tolerance, find the few nodes to keep
in higher precision.

1. Sensitivity, one of two ways (GuardSensitivity):
   - one-pass (the default): run the FP32 graph and the plain INT8 graph once on the held-out inputs
     and rank the quantized nodes by the error each adds (steps/sensitivity.py); no extra quantization.
     Where its search finds no mix, the exhaustive ranking runs before INT8 is given up (escalated).
   - exhaustive: quantize each quantizable node *alone* (same recipe, same calibration data) and
     measure how far that variant moves from FP32 on the held-out inputs (damage = 1 - mean cosine,
     plus the top-1 disagreement for classifiers): one full quantization per node.
2. Search: exclude the most sensitive nodes from quantization, k = 1, 2, 4, ... until the variant
   meets its tolerance, then bisect down to the smallest such k. Every candidate is a real
   re-quantization checked with the real tolerance.
3. No INT8 mix within the budget meets it: fall back to the FP16 variant.

Each quantization is cached like any other calibration, so a re-run costs little.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import onnx
from numpy.typing import NDArray

from builder.repository import onnx_files
from builder.runtimes.base import feeds as sample_feeds
from builder.runtimes.onnxruntime import ort_throughput, run_file
from builder.spec.enums import GuardSensitivity, Precision, Task
from builder.spec.model import CalibrationSpec, Tolerance
from builder.steps import accuracy, int8_recipe, precision
from builder.steps.accuracy import Metrics
from builder.steps.resources import peak_rss_mib
from builder.steps.sensitivity import FIGURES, SensitivityRecord, one_pass
from common import progress

log = logging.getLogger(__name__)

_QDQ = ("QuantizeLinear", "DequantizeLinear")


@dataclass(frozen=True)
class Attempt:
    """One candidate of the search: the k most sensitive nodes excluded, and how it measured."""

    excluded: int
    passes: bool
    metrics: Metrics
    ranking: GuardSensitivity = GuardSensitivity.EXHAUSTIVE  # whose order the k nodes were taken from


@dataclass
class GuardResult:
    met: bool
    excluded: list[str]
    sensitivity: dict[str, float]  # node -> damage when quantized alone, or error added (one pass)
    before: Metrics
    after: Metrics | None
    quantizations: int  # how many quantized variants the analysis and search built
    searched: list[Attempt] = field(default_factory=list)
    seconds: float = 0.0
    ranking: SensitivityRecord | None = None


# Dynamic quantization's integer ops, named after the float node they replace plus this suffix.
_DYNAMIC_OPS = frozenset({"MatMulInteger", "ConvInteger"})
_DYNAMIC_SUFFIX = "_quant"


def quantized_nodes(model: onnx.ModelProto) -> list[str]:
    """The nodes this quantization touched, in graph order, by the names the quantizer excludes them by: compute
    nodes fed by a DequantizeLinear (Q/DQ), or the float nodes dynamic quantization replaced by integer ops."""
    dq_outputs = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    return [n.name.removesuffix(_DYNAMIC_SUFFIX) if n.op_type in _DYNAMIC_OPS else n.name for n in model.graph.node
            if n.name and (n.op_type in _DYNAMIC_OPS
                           or (n.op_type not in _QDQ and any(i in dq_outputs for i in n.input)))]


def guard(
    quantize: Callable[[CalibrationSpec, Path], None],
    *,
    spec: CalibrationSpec,
    plain: Path,
    evaluation: Mapping[str, NDArray[Any]],
    reference: Mapping[str, NDArray[Any]],
    task: Task,
    tolerance: Tolerance,
    work: Path,
    max_excluded_fraction: float = 0.5,
    batch_size: int | None = 16,
    method: GuardSensitivity = GuardSensitivity.EXHAUSTIVE,
    fp32: Path | None = None,
    escalate: bool = True,
    measure: Callable[[Path], Metrics] | None = None,
) -> tuple[GuardResult, Path | None]:
    """Return the search's result and the path of the guarded INT8 ONNX (None: fall back to FP16).
    `method` ONE_PASS needs `fp32`, the graph `plain` was quantized from; with `escalate`, a one-pass ranking
    whose search finds no mix is followed by the exhaustive ranking and its search. `measure` scores a
    candidate as the gate will (every shape level); by default, on `evaluation` against `reference` only."""
    started = time.perf_counter()

    def evaluate(path: Path) -> Metrics:
        if measure is not None:
            return measure(path)
        return accuracy.compare(reference, run_file(path, evaluation, batch_size), task)

    before = evaluate(plain)
    nodes = quantized_nodes(onnx.load(str(plain), load_external_data=False))  # names only: no weights
    if not nodes:  # nothing to keep in higher precision: no ranking, no search (it re-quantized the same graph)
        log.warning("INT8 guard: the INT8 graph has no quantized node; no mix to search")
        return GuardResult(False, [], {}, before, None, 0, [], time.perf_counter() - started,
                           SensitivityRecord(method, FIGURES[method], 0, 0.0, None, peak_rss_mib())), None
    log.debug("INT8 guard: %d quantized nodes; measuring their sensitivity (%s)", len(nodes), method)
    builds = 0
    searched: list[Attempt] = []

    def rank(how: GuardSensitivity) -> dict[str, float]:
        nonlocal builds
        if how is GuardSensitivity.ONE_PASS:
            if fp32 is None:
                raise AssertionError("one-pass sensitivity needs the FP32 graph")
            return sensitivity_one_pass(fp32, plain, nodes, evaluation, batch_size)
        figures: dict[str, float] = {}
        with progress.task("INT8 guard: sensitivity, one node quantized at a time", total=len(nodes)) as bar:
            for index, node in enumerate(nodes):
                out = work / f"alone_{index}.onnx"
                quantize(replace(spec, nodes_to_quantize=(node,), nodes_to_exclude=()), out)
                builds += 1
                figures[node] = evaluate(out).damage()
                bar.advance(status=node)
        return figures

    limit = max(1, int(len(nodes) * max_excluded_fraction))

    def search(order: list[str], how: GuardSensitivity) -> tuple[int | None, dict[int, tuple[bool, Metrics, Path]]]:
        """The fewest of `order`'s first nodes to exclude for the tolerance: k = 1, 2, 4, ... then bisection."""
        cache: dict[int, tuple[bool, Metrics, Path]] = {}

        def attempt(k: int) -> bool:
            nonlocal builds
            if k not in cache:
                out = work / f"exclude_{how.name.lower()}_{k}.onnx"
                excluded = tuple(dict.fromkeys((*spec.nodes_to_exclude, *order[:k])))
                quantize(replace(spec, nodes_to_exclude=excluded), out)
                builds += 1
                metrics = evaluate(out)
                cache[k] = (accuracy.violation(metrics, tolerance, "candidate") is None, metrics, out)
                searched.append(Attempt(k, cache[k][0], metrics, how))
                search_bar.advance(status=f"{k} excluded: {'meets' if cache[k][0] else 'misses'} the tolerance")
            return cache[k][0]

        k, found = 1, None
        # The search's length depends on where the tolerance is met: a count of candidates, no total.
        with progress.task("INT8 guard: searching the fewest nodes to keep unquantized", loop=True) as search_bar:
            while k <= limit:
                if attempt(k):
                    found = k
                    break
                k *= 2
            if found is None and limit not in cache and attempt(limit):
                found = limit
            if found is not None:
                low = found // 2 + 1 if found > 1 else 1  # the largest failing k is found // 2
                high = found
                while low < high:
                    mid = (low + high) // 2
                    if attempt(mid):
                        high = mid
                    else:
                        low = mid + 1
                found = high
        return found, cache

    ranking_started = time.perf_counter()
    sensitivity = rank(method)
    ranked_in = time.perf_counter() - ranking_started
    order = sorted(nodes, key=lambda n: sensitivity[n], reverse=True)
    found, cache = search(order, method)
    escalated = found is None and method is GuardSensitivity.ONE_PASS and escalate
    if escalated:
        # The one-pass figure is first-order: it misses damage that only shows downstream of a tensor whose
        # relative error an outlier channel hides, and ONNX Runtime's recipe rounds a tensor where its
        # producer writes it too (excluding the consumer alone keeps that rounding). Before giving up on
        # INT8, the exhaustive ranking decides.
        log.info("INT8 guard: no mix in the one-pass ranking's first %d nodes meets the tolerance; ranking each "
                 "node by quantizing it alone", limit)
        ranking_started = time.perf_counter()
        sensitivity = rank(GuardSensitivity.EXHAUSTIVE)
        ranked_in += time.perf_counter() - ranking_started
        order = sorted(nodes, key=lambda n: sensitivity[n], reverse=True)
        found, cache = search(order, GuardSensitivity.EXHAUSTIVE)
    figure = FIGURES[GuardSensitivity.EXHAUSTIVE if escalated else method]

    def ranking(kept: int | None) -> SensitivityRecord:
        return SensitivityRecord(method, figure, len(nodes), round(ranked_in, 2), kept, peak_rss_mib(), escalated)

    seconds = time.perf_counter() - started
    if found is None:
        log.warning("INT8 guard: no mix with up to %d of %d nodes excluded meets the tolerance", limit, len(order))
        return GuardResult(False, [], sensitivity, before, None, builds, searched, seconds, ranking(None)), None
    _, after, path = cache[found]
    log.info("INT8 guard: %d node(s) kept in higher precision: %s", found, ", ".join(order[:found]))
    return GuardResult(True, order[:found], sensitivity, before, after, builds, searched, seconds,
                       ranking(found)), path


def sensitivity_one_pass(fp32: Path, plain: Path, nodes: list[str], evaluation: Mapping[str, NDArray[Any]],
                         batch_size: int | None) -> dict[str, float]:
    """The error each quantized node adds, from one run of each graph (steps/sensitivity.py)."""
    return one_pass(fp32, plain, nodes, evaluation, batch_size, what="INT8 guard")


def throughput(path: Path, evaluation: Mapping[str, NDArray[Any]], seconds: float = 1.0, *,
               batching: bool = True) -> float:
    """Batch-1 inferences per second under ONNX Runtime on this CPU (a quick cost estimate); one whole
    sample for a model that does not batch."""
    feed = next(sample_feeds(evaluation, 1 if batching else None))
    return ort_throughput(path, feed, seconds=seconds)


def make_quantizer(fp32_path: Path, fp32_sha: str, calibration: Mapping[str, NDArray[Any]], calib_digest: str,
                   cache_dir: Path, what: str = "", *, runtime: str = int8_recipe.CPU_RUNTIME,
                   log_file: Path | None) -> Callable[[CalibrationSpec, Path], None]:
    def quantize(spec: CalibrationSpec, out: Path) -> None:
        precision.to_int8(fp32_path, fp32_sha=fp32_sha, calibration=calibration, data_digest=calib_digest,
                          spec=spec, out_path=out, cache_dir=cache_dir, what=what, runtime=runtime,
                          log_file=log_file)

    return quantize


@dataclass(frozen=True)
class Sensitivity:
    node: str
    damage: float  # 1 - mean cosine (+ top-1 disagreement) with only this node quantized


@dataclass(frozen=True)
class VariantFigures:
    fp32: float
    int8_plain: float
    int8_guarded: float


@dataclass
class GuardReport:
    """What the guard did to one INT8 variant, as recorded in build.json."""

    excluded: list[str]  # nodes kept in higher precision
    fallback: Precision | None  # FP16 served under the INT8 name when no INT8 mix met the tolerance
    before: Metrics
    after: Metrics | None
    quantizations: int
    search: list[Attempt]
    most_sensitive: list[Sensitivity]
    seconds: float
    size_bytes: VariantFigures
    throughput_b1_cpu: VariantFigures
    sensitivity: SensitivityRecord | None = None  # how the nodes were ranked, in what time and memory


def guard_int8(*, fp32_path: Path, fp32_sha: str, calibration: Mapping[str, NDArray[Any]], calibration_digest: str,
               spec: CalibrationSpec, variant_onnx: Path, evaluation: Mapping[str, NDArray[Any]],
               reference: Mapping[str, NDArray[Any]], task: Task, tolerance: Tolerance, cache_dir: Path,
               work: Path, fp16_feeds: Sequence[Mapping[str, NDArray[Any]]], what: str, log_file: Path | None,
               batch_size: int | None = 16,
               method: GuardSensitivity = GuardSensitivity.ONE_PASS,
               measure: Callable[[Path], Metrics] | None = None,
               runtime: str = int8_recipe.CPU_RUNTIME) -> GuardReport:
    """Replace variant_onnx by the guarded INT8 mix, or by FP16 when none meets the tolerance. `measure`:
    how the gate scores a candidate (all its shape levels), so the search's pick is the one the gate passes."""
    plain = work / "int8_plain.onnx"
    onnx_files.copy_model(variant_onnx, plain)
    search_dir = work / "guard"
    search_dir.mkdir(exist_ok=True)
    quantize = make_quantizer(fp32_path, fp32_sha, calibration, calibration_digest, cache_dir, what,
                              runtime=runtime, log_file=log_file)
    result, guarded = guard(quantize, spec=spec, plain=plain, evaluation=evaluation, reference=reference,
                            task=task, tolerance=tolerance, work=search_dir, batch_size=batch_size,
                            method=method, fp32=fp32_path, measure=measure)
    fallback = None
    if guarded is not None:
        onnx_files.copy_model(guarded, variant_onnx)
    else:
        precision.to_fp16(fp32_path, variant_onnx, feeds=fp16_feeds, what=what, log_file=log_file)
        fallback = Precision.FP16
        log.warning("%s: no INT8 mix meets the tolerance; serving the FP16 model under the INT8 name", what)
    top = sorted(result.sensitivity.items(), key=lambda kv: kv[1], reverse=True)[:10]
    return GuardReport(
        excluded=result.excluded, fallback=fallback, before=result.before, after=result.after,
        quantizations=result.quantizations, search=result.searched,
        most_sensitive=[Sensitivity(n, d) for n, d in top], seconds=round(result.seconds, 2),
        size_bytes=VariantFigures(fp32_path.stat().st_size, plain.stat().st_size, variant_onnx.stat().st_size),
        throughput_b1_cpu=VariantFigures(*(throughput(path, evaluation, batching=batch_size is not None)
                                           for path in (fp32_path, plain, variant_onnx))),
        sensitivity=result.ranking,
    )
