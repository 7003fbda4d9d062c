"""Accuracy-guarded INT8: when a quantized variant misses its tolerance, find the few nodes to keep
in higher precision.

1. Sensitivity, one of two ways (GuardSensitivity):
   - one-pass (the default): run the FP32 graph and the plain INT8 graph once on the held-out inputs
     and rank the quantized nodes by the error each adds (steps/sensitivity.py); no extra quantization.
     Its candidates are derived from the plain INT8 graph (steps/qdq_mix.py): the excluded nodes read FP32,
     and so do those ModelOpt would leave unquantized with them (its placement, from a run on one sample);
     every other Q/DQ pair keeps the plain graph's calibrated scale, so one calibration serves the whole
     guard (a tensor's range depends on the FP32 graph and the data, not on which nodes are quantized).
     Where its search finds no mix, ModelOpt's recipe ranks by the exhaustive figure too (escalated).
   - exhaustive: quantize each quantizable node *alone* (same recipe, same calibration data) and
     measure how far that variant moves from FP32 on the held-out inputs (damage = 1 - mean cosine,
     plus the top-1 disagreement for classifiers; 1 - detection agreement for detectors): one full
     quantization per node, and one per candidate.
2. Search: exclude the most sensitive nodes from quantization, k = 1, 2, 4, ... (up to half of the nodes)
   until the variant meets its tolerance, then bisect down to the smallest such k. One pass, where no such
   k does: the smallest passing k beyond half, then pruned back node by node to at most half. Every
   candidate is checked with the real tolerance, as the gate scores it.
3. No INT8 mix within the budget meets it: fall back to the FP16 variant.

Each quantization is cached like any other calibration, so a re-run costs little.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import onnx
from numpy.typing import NDArray

from builder.errors import OnnxModelError, ToolError
from builder.repository import onnx_files
from builder.runtimes.base import ReferenceExecutor
from builder.runtimes.base import feeds as sample_feeds
from builder.spec.enums import GuardSensitivity, Int8Recipe, Precision, Task
from builder.spec.model import CalibrationSpec, Tolerance
from builder.steps import accuracy, int8_recipe, precision, qdq_mix
from builder.steps.accuracy import Metrics
from builder.steps.budget import Budget, BudgetSpent
from builder.steps.qdq_mix import quantized_nodes
from builder.steps.resources import peak_rss_mib
from builder.steps.sensitivity import FIGURES, SensitivityRecord, one_pass
from common import progress

log = logging.getLogger(__name__)

# A candidate that cannot be derived from the plain graph, or whose derived graph the executor refuses (its
# `errors`, added where the guard runs): that candidate is quantized again instead.
_UNDERIVABLE: tuple[type[BaseException], ...] = (qdq_mix.MixError, precision.PlacementUnknown)


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
    quantizations: int  # how many times the analysis and search quantized (calibrated) again
    searched: list[Attempt] = field(default_factory=list)
    seconds: float = 0.0
    ranking: SensitivityRecord | None = None
    derived: int = 0  # candidates derived from the plain graph's calibration (qdq_mix): no quantization
    budget_spent: bool = False  # the search stopped at its time budget (budget.Budget)


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
    executor: ReferenceExecutor,
    max_excluded_fraction: float = 0.5,
    batch_size: int | None = 16,
    method: GuardSensitivity = GuardSensitivity.EXHAUSTIVE,
    fp32: Path | None = None,
    escalate: bool = True,
    measure: Callable[[Path], Metrics] | None = None,
    float_graph: Path | None = None,
    placement: Callable[[CalibrationSpec], Collection[str]] | None = None,
    budget_s: float | None = None,
) -> tuple[GuardResult, Path | None]:
    """Return the search's result and the path of the guarded INT8 ONNX (None: fall back to FP16).
    `method` ONE_PASS needs `fp32`, the graph `plain` was quantized from; its candidates are derived from `plain`
    (qdq_mix; `float_graph`: the graph the quantizer was given where it changed `fp32` first, default `fp32`),
    `quantize` runs only for one that cannot be; `placement` (the nodes the recipe quantizes given its exclusions,
    where that depends on them) decides which nodes a candidate leaves in FP32 besides those it excludes;
    with `escalate`, a one-pass ranking whose search finds no mix is
    followed by the exhaustive ranking and its search. EXHAUSTIVE quantizes every candidate. `measure` scores a
    candidate as the gate will (every shape level); by default, on `evaluation` against `reference` only, run by
    `executor`, whose `errors` on a derived candidate mean: quantize that one instead. Past `budget_s` seconds
    (None: no bound) no further candidate is tried: no mix found within it."""
    started = time.perf_counter()
    budget = Budget(budget_s)
    underivable = (*_UNDERIVABLE, *executor.errors)

    def evaluate(path: Path) -> Metrics:
        if measure is not None:
            return measure(path)
        return accuracy.compare(reference, executor.run(path, evaluation, batch_size), task)

    before = evaluate(plain)
    plain_graph = onnx.load(str(plain), load_external_data=False)  # names only: no weights
    nodes = quantized_nodes(plain_graph)
    # Dynamic quantization has no calibrated scale to keep: its candidates are quantized again (no calibration).
    dynamic = any(n.op_type in qdq_mix.DYNAMIC_OPS for n in plain_graph.graph.node)
    del plain_graph
    if not nodes:  # nothing to keep in higher precision: no ranking, no search (it re-quantized the same graph)
        log.warning("INT8 guard: the INT8 graph has no quantized node; no mix to search")
        return GuardResult(False, [], {}, before, None, 0, [], time.perf_counter() - started,
                           SensitivityRecord(method, FIGURES[method], 0, 0.0, None, peak_rss_mib())), None
    log.debug("INT8 guard: %d quantized nodes; measuring their sensitivity (%s)", len(nodes), method)
    builds = derived = 0
    searched: list[Attempt] = []
    met: list[tuple[list[str], Metrics, Path]] = []  # every candidate that met the tolerance
    # One pass derives its candidates from the plain graph's calibration; exhaustive is the slow reference.
    derive = method is GuardSensitivity.ONE_PASS and fp32 is not None and not dynamic
    graphs: list[onnx.ModelProto] = []  # the plain Q/DQ graph and its float graph, loaded once when first needed

    def score(out: Path, *, excluded: Sequence[str] = (), alone: str | None = None) -> Metrics:
        """A candidate's figures: `excluded` kept in higher precision, or `alone` the only node quantized."""
        nonlocal builds, derived
        budget.check()
        if derive:
            assert fp32 is not None
            try:
                if not graphs:
                    graphs.extend((onnx_files.load(plain), onnx_files.load(float_graph or fp32)))
                drop: Collection[str]
                if alone is not None:
                    drop = [n for n in nodes if n != alone]
                elif placement is None:
                    drop = excluded
                else:  # as the recipe places Q/DQ for these exclusions (ModelOpt leaves a fused Add too)
                    kept = set(placement(replace(spec, nodes_to_exclude=tuple(
                        dict.fromkeys((*spec.nodes_to_exclude, *excluded))))))
                    drop = [n for n in nodes if n in excluded or n not in kept]
                onnx_files.save(qdq_mix.unquantize(graphs[0], drop, graphs[1]), out)
                metrics = evaluate(out)
                derived += 1
                return metrics
            except underivable as exc:
                log.debug("INT8 guard: candidate not derived from the plain INT8 graph (%s); quantizing it", exc)
        if alone is not None:
            quantize(replace(spec, nodes_to_quantize=(alone,), nodes_to_exclude=()), out)
        else:
            quantize(replace(spec, nodes_to_exclude=tuple(dict.fromkeys((*spec.nodes_to_exclude, *excluded)))), out)
        builds += 1
        return evaluate(out)

    def rank(how: GuardSensitivity) -> dict[str, float]:
        if how is GuardSensitivity.ONE_PASS:
            if fp32 is None:
                raise AssertionError("one-pass sensitivity needs the FP32 graph")
            return sensitivity_one_pass(fp32, plain, nodes, evaluation, batch_size)
        figures: dict[str, float] = {}
        with progress.task("INT8 guard: sensitivity, one node quantized at a time", total=len(nodes)) as bar:
            for index, node in enumerate(nodes):
                figures[node] = score(work / f"alone_{index}.onnx", alone=node).damage()
                bar.advance(status=node)
        return figures

    limit = max(1, int(len(nodes) * max_excluded_fraction))

    def search(order: list[str], how: GuardSensitivity) -> tuple[list[str], Metrics, Path] | None:
        """The fewest of `order`'s first nodes to exclude for the tolerance (k = 1, 2, 4, ... then bisection), at
        most `limit`. Where none is, with derived candidates (cheap): the smallest passing prefix beyond the
        limit, pruned back node by node, the least sensitive first (the one-pass figure is first-order: the
        nodes that matter can sit lower in its order)."""
        tried: dict[frozenset[str], tuple[bool, Metrics, Path]] = {}

        def attempt(excluded: list[str]) -> bool:
            key = frozenset(excluded)
            if key not in tried:
                out = work / f"exclude_{how.name.lower()}_{len(tried)}.onnx"
                metrics = score(out, excluded=excluded)
                tried[key] = (accuracy.violation(metrics, tolerance, "candidate") is None, metrics, out)
                if tried[key][0] and len(key) <= limit:
                    met.append((list(excluded), metrics, out))
                searched.append(Attempt(len(key), tried[key][0], metrics, how))
                search_bar.advance(status=f"{len(key)} excluded: {'meets' if tried[key][0] else 'misses'} the "
                                          "tolerance")
            return tried[key][0]

        def smallest_prefix(first: int, last: int) -> int | None:
            """The smallest k in first..last whose prefix passes (k doubling, then bisection)."""
            k, failed = first, first - 1
            while k <= last:
                if attempt(order[:k]):
                    break
                failed, k = k, k * 2
            else:
                if failed == last or not attempt(order[:last]):
                    return None
                k = last
            low, high = failed + 1, k
            while low < high:
                mid = (low + high) // 2
                if attempt(order[:mid]):
                    high = mid
                else:
                    low = mid + 1
            return high

        # The search's length depends on where the tolerance is met: a count of candidates, no total.
        with progress.task("INT8 guard: searching the fewest nodes to keep unquantized", loop=True) as search_bar:
            found = smallest_prefix(1, limit)
            if found is not None:
                chosen = order[:found]
            elif derive and limit < len(order):
                beyond = smallest_prefix(limit + 1, len(order))
                if beyond is None:
                    return None
                chosen = order[:beyond]
                candidates = list(reversed(chosen))
                for left, node in enumerate(candidates):
                    if len(chosen) - limit > len(candidates) - left:
                        return None  # each try drops one node at most: the limit is out of reach
                    trial = [n for n in chosen if n != node]
                    if trial and attempt(trial):
                        chosen = trial
                if len(chosen) > limit:
                    return None
            else:
                return None
        _, metrics, path = tried[frozenset(chosen)]
        return chosen, metrics, path

    sensitivity: dict[str, float] = {}
    ranked_in, escalated, found = 0.0, False, None
    try:
        ranking_started = time.perf_counter()
        sensitivity = rank(method)
        ranked_in = time.perf_counter() - ranking_started
        order = sorted(nodes, key=lambda n: sensitivity[n], reverse=True)
        found = search(order, method)
        escalated = found is None and method is GuardSensitivity.ONE_PASS and escalate
        if escalated:
            # The one-pass figure is first-order: it misses damage that only shows downstream of a tensor whose
            # relative error an outlier channel hides. Before giving up on INT8, the exhaustive ranking decides
            # (its candidates derived too: one evaluation per node).
            log.info("INT8 guard: no mix of at most %d nodes found from the one-pass ranking meets the tolerance; "
                     "ranking each node by quantizing it alone", limit)
            ranking_started = time.perf_counter()
            sensitivity = rank(GuardSensitivity.EXHAUSTIVE)
            ranked_in += time.perf_counter() - ranking_started
            order = sorted(nodes, key=lambda n: sensitivity[n], reverse=True)
            found = search(order, GuardSensitivity.EXHAUSTIVE)
    except BudgetSpent:
        # What met the tolerance before the budget ran out still counts: the fewest nodes kept.
        found = min(met, key=lambda item: len(item[0])) if met else None
        log.warning("INT8 guard: its budget of %g s was spent after %d candidates; %s (--guard-budget raises it)",
                    budget_s, builds + derived,
                    "no mix found within it" if found is None else "the best mix found within it is kept")
    figure = FIGURES[GuardSensitivity.EXHAUSTIVE if escalated else method]

    def ranking(kept: int | None) -> SensitivityRecord:
        return SensitivityRecord(method, figure, len(nodes), round(ranked_in, 2), kept, peak_rss_mib(), escalated)

    seconds = time.perf_counter() - started
    if found is None:
        if not budget.spent:
            log.warning("INT8 guard: no mix with up to %d of %d nodes excluded meets the tolerance", limit, len(nodes))
        return GuardResult(False, [], sensitivity, before, None, builds, searched, seconds, ranking(None),
                           derived, budget.spent), None
    excluded, after, path = found
    log.info("INT8 guard: %d node(s) kept in higher precision: %s (%d candidates derived from the plain INT8 "
             "graph's calibration, %d quantized again)", len(excluded), ", ".join(excluded), derived, builds)
    return GuardResult(True, excluded, sensitivity, before, after, builds, searched, seconds, ranking(len(excluded)),
                       derived, budget.spent), path


def sensitivity_one_pass(fp32: Path, plain: Path, nodes: list[str], evaluation: Mapping[str, NDArray[Any]],
                         batch_size: int | None) -> dict[str, float]:
    """The error each quantized node adds, from one run of each graph (steps/sensitivity.py)."""
    return one_pass(fp32, plain, nodes, evaluation, batch_size, what="INT8 guard")


def throughput(path: Path, evaluation: Mapping[str, NDArray[Any]], seconds: float = 1.0, *,
               executor: ReferenceExecutor, batching: bool = True) -> float:
    """Batch-1 inferences per second under the reference executor (ONNX Runtime on this CPU: a quick cost
    estimate); one whole sample for a model that does not batch."""
    feed = next(sample_feeds(evaluation, 1 if batching else None))
    return executor.throughput(path, feed, seconds=seconds)


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
    damage: float  # Metrics.damage() with only this node quantized (1 - mean cosine, + top-1 disagreement, ...)


@dataclass(frozen=True)
class VariantFigures:
    fp32: float
    int8_plain: float
    int8_guarded: float


@dataclass
class GuardReport:
    """What the guard did to one INT8 variant, as recorded in build.json."""

    excluded: list[str]  # nodes kept in higher precision
    fallback: Precision | None  # FP16 (else FP32) served under the INT8 name when no INT8 mix met the tolerance
    before: Metrics
    after: Metrics | None
    quantizations: int  # calibrated again
    search: list[Attempt]
    most_sensitive: list[Sensitivity]
    seconds: float
    size_bytes: VariantFigures
    throughput_b1_cpu: VariantFigures
    sensitivity: SensitivityRecord | None = None  # how the nodes were ranked, in what time and memory
    derived: int = 0  # candidates derived from the plain INT8 graph's calibration (no quantization)
    budget_s: float | None = None  # the search's time budget (None: no bound)
    budget_spent: bool = False  # the search stopped at it


def guard_int8(*, fp32_path: Path, fp32_sha: str, calibration: Mapping[str, NDArray[Any]], calibration_digest: str,
               spec: CalibrationSpec, variant_onnx: Path, evaluation: Mapping[str, NDArray[Any]],
               reference: Mapping[str, NDArray[Any]], task: Task, tolerance: Tolerance, cache_dir: Path,
               work: Path, fp16_feeds: Sequence[Mapping[str, NDArray[Any]]], what: str, log_file: Path | None,
               executor: ReferenceExecutor, batch_size: int | None = 16,
               method: GuardSensitivity = GuardSensitivity.ONE_PASS,
               measure: Callable[[Path], Metrics] | None = None,
               float_graph: Path | None = None,
               runtime: str = int8_recipe.CPU_RUNTIME, budget_s: float | None = None) -> GuardReport:
    """Replace variant_onnx by the guarded INT8 mix, or by FP16 when none meets the tolerance. `measure`:
    how the gate scores a candidate (all its shape levels), so the search's pick is the one the gate passes.
    `float_graph`: the graph the quantizer was given, where it changed the FP32 graph first (ONNX Runtime's
    recipe: precision.float_graph)."""
    plain = work / "int8_plain.onnx"
    onnx_files.copy_model(variant_onnx, plain)
    search_dir = work / "guard"
    search_dir.mkdir(exist_ok=True)
    quantize = make_quantizer(fp32_path, fp32_sha, calibration, calibration_digest, cache_dir, what,
                              runtime=runtime, log_file=log_file)
    # ONNX Runtime's recipe (where ModelOpt failed) does not escalate to the exhaustive ranking: what made its
    # one-pass search miss (a tensor rounded where its producer writes it, which excluding the consumer kept)
    # is gone now that a candidate reads FP32 at the excluded node itself, and each of its quantizations is a
    # subprocess.
    # `spec` is the recipe the plain INT8 ran with (CalibrationResult.spec: "auto" resolved); resolved here too
    # for a caller that passes the user's.
    recipe = int8_recipe.choose_for(fp32_path, spec.recipe, runtime).recipe
    modelopt = recipe is Int8Recipe.MODELOPT

    def placement(candidate: CalibrationSpec) -> list[str]:
        return precision.modelopt_placement(fp32_path, calibration, candidate)

    result, guarded = guard(quantize, spec=spec, plain=plain, evaluation=evaluation, reference=reference,
                            task=task, tolerance=tolerance, work=search_dir, executor=executor, batch_size=batch_size,
                            method=method, fp32=fp32_path, measure=measure, float_graph=float_graph,
                            escalate=modelopt, placement=placement if modelopt else None, budget_s=budget_s)
    fallback = None
    if guarded is not None:
        onnx_files.copy_model(guarded, variant_onnx)
    else:
        fallback = Precision.FP16
        failures: tuple[type[Exception], ...] = (ToolError, OnnxModelError, *executor.errors)
        try:
            precision.to_fp16(fp32_path, variant_onnx, feeds=fp16_feeds, what=what, log_file=log_file)
            scored = measure(variant_onnx) if measure is not None else None
            missed = scored is not None and accuracy.violation(scored, tolerance, "fallback") is not None
        except failures as exc:
            log.debug("%s: the FP16 fallback of the INT8 guard did not convert or run: %s", what, exc)
            missed = True
        if missed:
            # FP16 misses it too (PP-OCR's detector on images with no text: every output near zero) or does not
            # convert or run: the FP32 graph is served under the INT8 name, as the FP16 guard does under FP16's.
            onnx_files.copy_model(fp32_path, variant_onnx)
            fallback = Precision.FP32
        log.warning("%s: no INT8 mix meets the tolerance; serving the %s model under the INT8 name", what,
                    fallback.value.upper())
    top = sorted(result.sensitivity.items(), key=lambda kv: kv[1], reverse=True)[:10]
    return GuardReport(
        excluded=result.excluded, fallback=fallback, before=result.before, after=result.after,
        quantizations=result.quantizations, derived=result.derived, search=result.searched,
        most_sensitive=[Sensitivity(n, d) for n, d in top], seconds=round(result.seconds, 2),
        size_bytes=VariantFigures(fp32_path.stat().st_size, plain.stat().st_size, variant_onnx.stat().st_size),
        throughput_b1_cpu=VariantFigures(*(throughput(path, evaluation, executor=executor,
                                                      batching=batch_size is not None)
                                           for path in (fp32_path, plain, variant_onnx))),
        sensitivity=result.ranking, budget_s=budget_s, budget_spent=result.budget_spent,
    )
