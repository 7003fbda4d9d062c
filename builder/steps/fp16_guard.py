"""Accuracy-guarded FP16: when the autocast FP16 variant misses its tolerance, find the few nodes (or op
types, or the range thresholds) that must stay in FP32, modelled on the INT8 guard (steps/guard.py).

ModelOpt autocast's levers: `nodes_to_exclude`, `op_types_to_exclude`, and `data_max` / `init_max` (a
node whose data or initializers exceed them on the calibration feeds stays in FP32).

1. Sensitivity, one of two ways (GuardSensitivity):
   - one-pass (the default): run the FP32 graph and the plain FP16 graph once on the held-out inputs and
     rank every FP16 node by the error it adds (steps/sensitivity.py); no extra conversion.
   - exhaustive: convert each FP16 node *alone* to FP16 (every other one kept in FP32) and measure how
     far that variant moves from FP32 on the held-out inputs. A large graph is narrowed first: each op
     type alone, then the nodes of the most damaging types, at most NODE_BUDGET of them.
2. Search: keep the most sensitive nodes in FP32, k = 1, 2, 4, ... (up to half of the FP16 nodes) until
   the variant meets its tolerance, then bisect to the smallest such k. Every candidate is a real
   conversion checked with the real tolerance.
3. No node set meets it: whole op types (the most damaging first), then lower data_max / init_max.
4. Nothing meets it: the FP32 model is served under the FP16 name, and the record says so.

Measured with ONNX Runtime on CPU, which runs several FP16 ops by casting to FP32 and removes cast pairs
between them: a model's FP16 error here can be smaller than under TensorRT's real FP16 kernels.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
from numpy.typing import NDArray

from builder.errors import ToolError
from builder.repository.onnx_files import copy_model, save, sha256_model
from builder.spec.enums import GuardSensitivity, Precision
from builder.spec.model import Tolerance
from builder.steps import accuracy
from builder.steps.accuracy import Metrics
from builder.steps.budget import Budget, BudgetSpent
from builder.steps.fp16_cache import cached_conversion, feeds_digest, fp16_key
from builder.steps.precision import Fp16Settings, to_fp16
from builder.steps.resources import peak_rss_mib
from builder.steps.sensitivity import FIGURES, SensitivityRecord, one_pass
from common import progress

log = logging.getLogger(__name__)

# Sensitivity conversions at most (each one runs autocast's reference pass and an evaluation).
NODE_BUDGET = 40
# Threshold levers tried when no node or op-type set meets the tolerance (data_max = init_max = each).
THRESHOLDS = (128.0, 32.0, 8.0)
_CAST = "Cast"

Convert = Callable[[Fp16Settings, Path], None]
Evaluate = Callable[[Path], Metrics]


def fp16_nodes(model: onnx.ModelProto) -> list[str]:
    """Nodes that compute in FP16 (an FP16 input or output), in graph order; Casts autocast added aside."""
    types: dict[str, int] = {}
    for value in (*model.graph.input, *model.graph.output, *model.graph.value_info):
        types[value.name] = value.type.tensor_type.elem_type
    for init in model.graph.initializer:
        types[init.name] = init.data_type
    for node in model.graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    types[node.output[0]] = attr.t.data_type
    half = onnx.TensorProto.FLOAT16
    return [n.name for n in model.graph.node
            if n.op_type != _CAST and any(types.get(t) == half for t in (*n.input, *n.output) if t)]


def named_copy(fp32_path: Path, out: Path) -> Path:
    """The FP32 graph with every node named (`<op>_<index>` where it had no name): exclusions are by name.
    Names are metadata; the computation is unchanged."""
    model = onnx.load(str(fp32_path))
    taken = {n.name for n in model.graph.node if n.name}
    for index, node in enumerate(model.graph.node):
        if not node.name:
            name = f"{node.op_type}_{index}"
            while name in taken:
                name += "_"
            node.name = name
            taken.add(name)
    save(model, out)
    return out


@dataclass(frozen=True)
class Fp16Attempt:
    """One candidate: what was kept in FP32, how many nodes still compute in FP16, and how it measured."""

    lever: str  # "nodes", "op_types" or "thresholds"
    settings: dict[str, object]
    fp16_nodes: int | None  # None: autocast refused these settings
    passes: bool
    metrics: Metrics | None
    error: str | None = None  # autocast's one-line reason, when it refused


@dataclass(frozen=True)
class NodeSensitivity:
    node: str
    op_type: str
    damage: float | None  # Metrics.damage() with only this node in FP16; None: refused


@dataclass
class Fp16GuardReport:
    """What the guard did to one FP16 variant, as recorded in build.json."""

    kept_fp32_nodes: list[str]
    kept_fp32_op_types: list[str]
    settings: dict[str, object]  # autocast's settings for the served model
    fallback: Precision | None  # FP32 served under the FP16 name when nothing met the tolerance
    before: Metrics
    after: Metrics | None
    fp16_nodes_plain: int
    fp16_nodes_guarded: int  # 0 after a fallback
    conversions: int
    search: list[Fp16Attempt] = field(default_factory=list)
    most_sensitive: list[NodeSensitivity] = field(default_factory=list)
    op_type_damage: dict[str, float | None] = field(default_factory=dict)  # None: autocast refused
    seconds: float = 0.0
    sensitivity: SensitivityRecord | None = None  # how the nodes were ranked, in what time and memory
    cached_conversions: int = 0  # of `conversions`, how many came from the cache (steps/fp16_cache.py)
    budget_s: float | None = None  # the search's time budget (None: no bound)
    budget_spent: bool = False  # the search stopped at it


@dataclass
class _Search:
    convert: Convert
    evaluate: Evaluate
    tolerance: Tolerance
    work: Path
    budget: Budget
    conversions: int = 0
    attempts: list[Fp16Attempt] = field(default_factory=list)

    def run(self, settings: Fp16Settings, tag: str) -> tuple[Metrics, Path, int] | ToolError:
        """One conversion and its figures; autocast refusing these settings (where plain FP16 worked)
        is a candidate that failed, not the end of the search."""
        out = self.work / f"{tag}.onnx"
        self.budget.check()
        self.conversions += 1
        try:
            self.convert(settings, out)
        except ToolError as exc:
            log.debug("FP16 guard: %s: %s", tag, exc)
            return exc
        return self.evaluate(out), out, len(fp16_nodes(onnx.load(str(out), load_external_data=False)))

    def attempt(self, settings: Fp16Settings, lever: str, tag: str) -> tuple[bool, Metrics | None, Path, int]:
        done = self.run(settings, tag)
        if isinstance(done, ToolError):
            self.attempts.append(Fp16Attempt(lever, settings.record(), None, False, None, str(done)))
            return False, None, self.work / f"{tag}.onnx", 0
        metrics, out, count = done
        # A mix with no node left in FP16 is the FP32 fallback in disguise: never a pass.
        passes = count > 0 and accuracy.violation(metrics, self.tolerance, "candidate") is None
        self.attempts.append(Fp16Attempt(lever, settings.record(), count, passes, metrics))
        log.debug("FP16 guard: %s %s: %s (%s)", lever, tag, "meets" if passes else "misses", metrics.summary())
        return passes, metrics, out, count


def _rank(done: tuple[Metrics, Path, int] | ToolError) -> tuple[float, float]:
    """Sort key, most damaging first when reversed. A conversion autocast refused ranks last: plain FP16
    converted that node, so the refusal says nothing about its damage."""
    if isinstance(done, ToolError):
        return (-math.inf, -math.inf)
    return (done[0].damage(), done[0].max_rel)


def guard(convert: Convert, evaluate: Evaluate, *, plain: Path, tolerance: Tolerance, work: Path,
          max_fp32_fraction: float = 0.5, method: GuardSensitivity = GuardSensitivity.EXHAUSTIVE,
          fp32: Path | None = None, evaluation: Mapping[str, NDArray[Any]] | None = None,
          batch_size: int | None = None, budget_s: float | None = None) -> tuple[Fp16GuardReport, Path | None]:
    """Search settings under which the FP16 variant meets `tolerance`; return the report and the model's
    path (None: nothing met it, fall back to FP32). `convert(settings, out)` writes one FP16 variant.
    `method` ONE_PASS needs `fp32` (the graph `plain` was converted from, with the same node names) and the
    held-out `evaluation` samples, run `batch_size` at a time (None: each sample whole). Past `budget_s` seconds
    (None: no bound) no further conversion is tried: no mix found within it."""
    started = time.perf_counter()
    search = _Search(convert, evaluate, tolerance, work, Budget(budget_s))
    before = evaluate(plain)
    plain_model = onnx.load(str(plain), load_external_data=False)  # node names and types only
    op_of = {n.name: n.op_type for n in plain_model.graph.node}
    candidates = fp16_nodes(plain_model)
    log.debug("FP16 guard: %d nodes compute in FP16; measuring their sensitivity", len(candidates))

    type_damage: dict[str, float] = {}
    measured = candidates
    sensitivity: dict[str, tuple[float, float]] = {}
    order: list[str] = []
    ranked_in: float = 0.0
    ranked_rss: float | None = None
    found: tuple[Fp16Settings, Metrics, Path, int] | None = None
    cache: dict[int, tuple[bool, Metrics | None, Path, int]] = {}  # nodes kept -> how that candidate measured
    passing: list[tuple[Fp16Settings, Metrics, Path, int]] = []  # the range thresholds that meet the tolerance
    try:
        # 1. Sensitivity: one pass, or one conversion per node (narrowed by op type on a large graph).
        ranking_started = time.perf_counter()
        if method is GuardSensitivity.ONE_PASS:
            if fp32 is None or evaluation is None:
                raise AssertionError("one-pass sensitivity needs the FP32 graph and the held-out samples")
            added = one_pass(fp32, plain, candidates, evaluation, batch_size, what="FP16 guard")
            sensitivity = {node: (added[node], 0.0) for node in candidates}
        elif len(candidates) > NODE_BUDGET:
            op_types = sorted({op_of[n] for n in candidates})
            for index, op_type in enumerate(op_types):
                others = tuple(t for t in op_types if t != op_type)
                type_damage[op_type] = _rank(search.run(Fp16Settings(op_types_to_exclude=others),
                                                        f"type_alone_{index}"))[0]
            measured = []
            for op_type in sorted(op_types, key=lambda t: type_damage[t], reverse=True):
                of_type = [n for n in candidates if op_of[n] == op_type]
                if measured and len(measured) + len(of_type) > NODE_BUDGET:
                    break
                measured.extend(of_type[: NODE_BUDGET - len(measured)])
        if method is GuardSensitivity.EXHAUSTIVE:
            with progress.task("FP16 guard: sensitivity, one node in FP16 at a time", total=len(measured)) as bar:
                for index, node in enumerate(measured):
                    others = tuple(n for n in candidates if n != node)
                    # data_max = inf skips autocast's reference run (the costly part on a large graph): every
                    # other node is excluded by name, and this one is within the thresholds (plain FP16 has it).
                    sensitivity[node] = _rank(search.run(Fp16Settings(nodes_to_exclude=others, data_max=math.inf),
                                                         f"node_alone_{index}"))
                    bar.advance(status=node)
        ranked_in, ranked_rss = round(time.perf_counter() - ranking_started, 2), peak_rss_mib()
        order = sorted(measured, key=lambda n: sensitivity[n], reverse=True)

        if not type_damage:
            for node in measured:
                type_damage[op_of[node]] = max(type_damage.get(op_of[node], 0.0), sensitivity[node][0])

        # 2. The fewest nodes kept in FP32.

        def keep(k: int) -> bool:
            if k not in cache:
                cache[k] = search.attempt(Fp16Settings(nodes_to_exclude=tuple(order[:k])), "nodes", f"keep_{k}")
            return cache[k][0]

        limit = min(len(order), max(1, int(len(candidates) * max_fp32_fraction)))
        k, first = 1, None
        while k <= limit:
            if keep(k):
                first = k
                break
            k *= 2
        if first is None and order and limit not in cache and keep(limit):
            first = limit
        if first is not None:
            low, high = (first // 2 + 1 if first > 1 else 1), first
            while low < high:
                mid = (low + high) // 2
                if keep(mid):
                    high = mid
                else:
                    low = mid + 1
            _, metrics, out, count = cache[high]
            assert metrics is not None, "a passing candidate was measured"
            found = (Fp16Settings(nodes_to_exclude=tuple(order[:high])), metrics, out, count)

        # 3. Whole op types, most damaging first; then the range thresholds.
        if found is None:
            ranked_types = sorted(type_damage, key=lambda t: type_damage[t], reverse=True)
            for count_types in range(1, len(ranked_types)):
                settings = Fp16Settings(op_types_to_exclude=tuple(ranked_types[:count_types]))
                passes, metrics, out, count = search.attempt(settings, "op_types", f"types_{count_types}")
                if passes and metrics is not None:
                    found = (settings, metrics, out, count)
                    break
        if found is None:
            for value in THRESHOLDS:
                settings = Fp16Settings(data_max=value, init_max=value)
                passes, metrics, out, count = search.attempt(settings, "thresholds", f"max_{value:g}")
                if passes and metrics is not None:
                    passing.append((settings, metrics, out, count))
            if passing:
                found = max(passing, key=lambda item: item[3])  # the one that keeps the most nodes in FP16
    except BudgetSpent:
        ranked_rss = ranked_rss or peak_rss_mib()
        # What met the tolerance before the budget ran out still counts: the fewest nodes kept, else the threshold
        # that keeps the most in FP16.
        met = sorted(k for k, (passes, *_rest) in cache.items() if passes)
        if met:
            _, metrics, out, count = cache[met[0]]
            assert metrics is not None, "a passing candidate was measured"
            found = (Fp16Settings(nodes_to_exclude=tuple(order[:met[0]])), metrics, out, count)
        elif passing:
            found = max(passing, key=lambda item: item[3])
        log.warning("FP16 guard: its budget of %g s was spent after %d conversions; %s (--guard-budget raises it)",
                    budget_s, search.conversions,
                    "no mix found within it" if found is None else "the best mix found within it is kept")

    def ranking(kept: int | None) -> SensitivityRecord:
        return SensitivityRecord(method, FIGURES[method], len(measured), ranked_in, kept, ranked_rss)

    def figure(damage: float) -> float | None:  # refused by autocast: no figure
        return None if math.isinf(damage) else round(damage, 9)

    top = [NodeSensitivity(n, op_of[n], figure(sensitivity[n][0])) for n in order[:10]]
    recorded_types = {t: figure(d) for t, d in type_damage.items()}
    seconds = round(time.perf_counter() - started, 2)
    if found is None:
        log.warning("FP16 guard: no FP16 mix meets the tolerance (%d conversions)", search.conversions)
        return Fp16GuardReport([], [], {}, Precision.FP32, before, None, len(candidates), 0, search.conversions,
                               search.attempts, top, recorded_types, seconds, ranking(None), budget_s=budget_s,
                               budget_spent=search.budget.spent), None
    settings, after, path, count = found
    log.info("FP16 guard: kept in FP32: %s; %d of %d nodes still in FP16",
             ", ".join(settings.nodes_to_exclude or settings.op_types_to_exclude)
             or f"nodes beyond data_max={settings.data_max:g}", count, len(candidates))
    return Fp16GuardReport(list(settings.nodes_to_exclude), list(settings.op_types_to_exclude), settings.record(),
                           None, before, after, len(candidates), count, search.conversions, search.attempts, top,
                           recorded_types, seconds, ranking(len(candidates) - count), budget_s=budget_s,
                           budget_spent=search.budget.spent), path


def guard_fp16(*, fp32_path: Path, feeds: Sequence[Mapping[str, NDArray[Any]]], variant_onnx: Path,
               evaluate: Evaluate, tolerance: Tolerance, what: str, work: Path, log_file: Path | None,
               evaluation: Mapping[str, NDArray[Any]] | None = None, batch_size: int | None = None,
               method: GuardSensitivity = GuardSensitivity.ONE_PASS, cache_dir: Path | None = None,
               budget_s: float | None = None) -> Fp16GuardReport:
    """Replace variant_onnx by the guarded FP16 mix, or by the FP32 model when none meets the tolerance.
    `evaluation` (held-out samples, run `batch_size` at a time) is what one-pass sensitivity runs on; with
    `cache_dir`, each conversion is reused from an earlier run with the same inputs (steps/fp16_cache.py)."""
    folder = work / "fp16_guard"
    folder.mkdir(exist_ok=True)
    named = named_copy(fp32_path, folder / "fp32_named.onnx")
    named_sha, feeds_sha = sha256_model(named), feeds_digest(feeds)
    reused = 0

    # How long the search runs depends on where the tolerance is met: a count of conversions, no total.
    with progress.task(f"FP16 guard: {what}") as bar:

        def convert(settings: Fp16Settings, out: Path) -> None:
            nonlocal reused

            def make(path: Path) -> dict[str, object]:
                return to_fp16(named, path, feeds=feeds, what=what, settings=settings, log_file=log_file)

            if cache_dir is None:
                make(out)
            else:
                key = fp16_key(fp32_sha=named_sha, feeds=feeds_sha, what_made_it=settings.record())
                reused += cached_conversion(cache_dir, key, out, make)[1]
            bar.advance(status="FP16 conversions")

        # The plain variant again, from the named graph, so its node names are the ones exclusions match.
        plain = folder / "fp16_plain.onnx"
        convert(Fp16Settings(), plain)
        reused = 0  # counted for the guard's own conversions (the report's), not this one
        if method is GuardSensitivity.ONE_PASS and evaluation is None:
            raise AssertionError("one-pass sensitivity needs the held-out samples")
        report, guarded = guard(convert, evaluate, plain=plain, tolerance=tolerance, work=folder, method=method,
                                fp32=named, evaluation=evaluation, batch_size=batch_size, budget_s=budget_s)
    report.cached_conversions = reused
    if guarded is not None:
        copy_model(guarded, variant_onnx)
    else:
        copy_model(fp32_path, variant_onnx)
        log.warning("%s: no FP16 mix meets the tolerance; serving the FP32 model under the FP16 name", what)
    return report
