"""The one summary `trtbuild engines`/`build` prints at the end: a table of every variant (built,
unchanged or failed) and where things are, with the next commands to run.

A rich table on a terminal; the same table in plain characters (no colour, no box-drawing) when
stdout is a file or a pipe.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from builder.repository.model_folder import load_shapes  # the shapes tune sends, from each build.json
from builder.spec.enums import Precision
from builder.spec.names import variant_name
from builder.steps.model_result import ModelResult, ModelStatus  # the records alone: no ONNX, ORT or ModelOpt

if TYPE_CHECKING:
    from builder.spec.model import ModelSpec

log = logging.getLogger(__name__)

# Tolerance keys (models.toml) → the metric they bound, its short label, and whether it is an upper limit.
_LIMITS: tuple[tuple[str, str, str, bool], ...] = (
    ("max_abs", "max_abs", "max_abs", True),
    ("max_rel", "max_rel", "max_rel", True),
    ("cosine_min", "cosine_min", "cos_min", False),
    ("cosine_mean_min", "cosine_mean", "cos_mean", False),
    ("top1_agreement_min", "top1_agreement", "top1", False),
    ("detection_agreement_min", "detection_agreement", "det", False),
)


@dataclass(frozen=True)
class FailedVariant:
    """A variant that did not build, with the one-line reason."""

    name: str
    precision: str
    reason: str


@dataclass(frozen=True)
class SummaryRow:
    variant: str
    precision: str
    runtime: str | None = None
    size_bytes: int | None = None
    accuracy: str = "-"  # each limit checked: the value against its tolerance
    within: bool | None = None  # within its tolerance; None: not measured (failed)
    kept: str = "-"  # what the guard kept in higher precision
    seconds: float | None = None
    state: str = "rebuilt"  # rebuilt | rebuilt, calibration cached | unchanged | FAILED
    reason: str | None = None  # why it failed
    model: str | None = None
    speed_ratio: float | None = None  # throughput against FP32's (1.0 for FP32 itself); None: not measured
    worth_serving: bool | None = None  # False: slower or larger than FP32 (the figures in `worth_reason`)
    worth_reason: str | None = None
    serve: bool = False  # the model's variant to serve: the fastest that met its tolerance
    # Faster than FP32 beyond the rounds' spread (its slowest round above FP32's fastest) and by PICK_MARGIN at
    # least; None: not compared. beyond_spread: the first half alone.
    clearly_faster: bool | None = None
    beyond_spread: bool | None = None
    spread: str | None = None  # the variant's rounds against FP32's, where compared: "118–130 vs FP32's 96–104"

    @property
    def failed(self) -> bool:
        return self.reason is not None


@dataclass(frozen=True)
class BuildSummary:
    rows: tuple[SummaryRow, ...]
    repository: Path
    report: Path | None = None
    log_file: Path | None = None
    next_commands: tuple[str, ...] = field(default_factory=tuple)

    @property
    def failures(self) -> tuple[SummaryRow, ...]:
        return tuple(r for r in self.rows if r.failed)


def _number(value: float) -> str:
    return f"{value:.4g}"


def accuracy_text(accuracy: Mapping[str, Any], tolerance: Mapping[str, Any]) -> tuple[str, bool | None]:
    """Each limit of the tolerance as `metric value ≥ limit` (✗ where missed), then top-1 agreement if
    measured but not limited; and whether every limit holds."""
    parts: list[str] = []
    within: bool | None = True
    for key, metric, label, upper in _LIMITS:
        limit = tolerance.get(key)
        if limit is None:
            continue
        value = accuracy.get(metric)
        if value is None:
            parts.append(f"{label} - (limit {limit:g})")
            within = None
            continue
        ok = value <= limit if upper else value >= limit
        within = within and ok if within is not None else None
        relation = ("≤" if ok else ">") if upper else ("≥" if ok else "<")
        parts.append(f"{label} {_number(value)} {relation} {limit:g}")
    top1 = accuracy.get("top1_agreement")
    if tolerance.get("top1_agreement_min") is None and top1 is not None:
        parts.append(f"top1 {top1:.3f}")
    detections = accuracy.get("detection_agreement")
    if tolerance.get("detection_agreement_min") is None and detections is not None:
        parts.append(f"det {detections:.3f}")
    return (", ".join(parts) or "-"), within


def _nodes(count: int) -> str:
    return f"{count} node{'s' if count != 1 else ''}"


def _within(guard: Mapping[str, Any]) -> str:
    """Where the guard's time budget ended its search, so the user knows a longer one might find a mix."""
    if not guard.get("budget_spent"):
        return ""
    return f" within the guard's {guard.get('budget_s', 0):g} s budget; --guard-budget raises it"


def guard_text(guard: Mapping[str, Any] | None, fp16_guard: Mapping[str, Any] | None = None) -> str:
    """What a guard kept in higher precision: INT8's unquantized nodes, FP16's FP32 nodes or op types, or
    the whole model served in the higher precision (a fallback)."""
    if guard:
        if guard.get("fallback"):
            return f"all: {str(guard['fallback']).upper()} served (no INT8 mix met the tolerance{_within(guard)})"
        excluded = guard.get("excluded") or []
        if excluded:
            return f"{_nodes(len(excluded))} unquantized"
    if fp16_guard:
        if fp16_guard.get("fallback"):
            return (f"all: {str(fp16_guard['fallback']).upper()} served (no FP16 mix met the tolerance"
                    f"{_within(fp16_guard)})")
        nodes = fp16_guard.get("kept_fp32_nodes") or []
        types = fp16_guard.get("kept_fp32_op_types") or []
        if nodes:
            return f"{_nodes(len(nodes))} in FP32"
        if types:
            return f"op types in FP32: {', '.join(types)}"
        if fp16_guard.get("settings"):
            settings = fp16_guard["settings"]
            return f"FP32 beyond data_max {settings.get('data_max', '?')}"
    return "-"


# How much faster than FP32 (median of the rounds) a lower precision must be to be the pick. The build measures
# in-process, in short rounds; served, the same variants differ by more: the corpus run of 2026-11-29 picked
# PP-OCRv4 rec's FP16 at 1.035x in-process (every round above FP32's), and served it ran 0.70x FP32. Every other
# lower-precision pick there was 1.5x or more in-process and faster served too.
PICK_MARGIN = 1.10
_ACCURACY_RANK = {p.value: rank for rank, p in enumerate(Precision)}  # the enum lists the most accurate first


def row_from_record(record: Mapping[str, Any], *, state: str) -> SummaryRow:
    """A row from a variant's record: a VariantResult's `to_json()` or the build.json holding it."""
    accuracy, within = accuracy_text(record.get("accuracy") or {}, record.get("tolerance") or {})
    calibration = record.get("calibration") or {}
    if state == "rebuilt" and calibration.get("cached"):
        state = "rebuilt, calibration cached"
    seconds = record.get("build_seconds")
    speed = record.get("speed") or {}
    # FP32 itself: 1.0; a variant not measured (only marked, as FP32's graph under its name): none.
    ratio = (speed.get("ratio") if speed.get("fp32_throughput") is not None
             else 1.0 if speed.get("throughput") is not None else None)
    rounds, fp32_rounds = _figures(speed.get("rounds")), _figures(speed.get("fp32_rounds"))
    beyond_spread = min(rounds) > max(fp32_rounds) if rounds and fp32_rounds else None
    clearly_faster = (beyond_spread and ratio is not None and float(ratio) >= PICK_MARGIN
                      if beyond_spread is not None else None)
    spread = (f"rounds {_rate(min(rounds))}–{_rate(max(rounds))} vs FP32's {_rate(min(fp32_rounds))}–"
              f"{_rate(max(fp32_rounds))} infer/s" if rounds and fp32_rounds else None)
    return SummaryRow(
        variant=str(record.get("name", "?")), precision=str(record.get("precision", "?")),
        runtime=record.get("runtime"), size_bytes=record.get("size_bytes"), accuracy=accuracy, within=within,
        kept=guard_text(record.get("guard"), record.get("fp16_guard")),
        seconds=float(seconds) if seconds is not None else None, state=state,
        model=record.get("model"), speed_ratio=float(ratio) if ratio is not None else None,
        worth_serving=speed.get("worth_serving"), worth_reason=speed.get("reason"), clearly_faster=clearly_faster,
        beyond_spread=beyond_spread, spread=spread,
    )


def _rate(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _figures(value: Any) -> list[float]:
    """A build record's list of throughputs; nothing for anything else (an older or hand-edited build.json)."""
    if not isinstance(value, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                              for v in value):
        return []
    return [float(v) for v in value]


def with_recommendation(rows: Sequence[SummaryRow]) -> list[SummaryRow]:
    """The rows with the variant to serve marked per model: the fastest (against FP32, at the opt shape) of
    those that met their tolerance and are worth serving, where a lower precision counts only if it was faster
    than FP32 beyond the rounds' spread and by PICK_MARGIN: on a busy machine a few short rounds can rank a
    slower variant first, and FP32 is the safe pick until a measurement says otherwise. None marked for a model
    whose variants were not measured (another runtime than ONNX Runtime on the CPU)."""
    best: dict[str | None, SummaryRow] = {}
    # Most accurate first: a less accurate precision takes the pick from a more accurate one only by PICK_MARGIN
    # (INT8 at 1.52x FP32 does not displace FP16 at 1.50x: the two are within the rounds' noise).
    for row in sorted(rows, key=lambda r: _ACCURACY_RANK.get(r.precision, len(_ACCURACY_RANK))):
        if row.failed or row.within is not True or row.speed_ratio is None or row.worth_serving is False:
            continue
        if row.precision != "fp32" and row.clearly_faster is not True:  # not shown faster than FP32 (yet)
            continue
        chosen = best.get(row.model)
        if chosen is None or chosen.precision == "fp32" or row.speed_ratio >= (chosen.speed_ratio or 0.0) * PICK_MARGIN:
            best[row.model] = row
    picked = {id(r) for r in best.values()}
    return [replace(r, serve=True) if id(r) in picked else r for r in rows]


def unchanged_rows(repository: Path, variants: Iterable[str]) -> list[SummaryRow]:
    """Rows of variants a build left as they were, from the build.json each holds."""
    rows = []
    for name in variants:
        try:
            record = json.loads((repository / name / "build.json").read_text())
        except (OSError, ValueError) as exc:
            log.debug("%s: no readable build.json (%s)", name, exc)
            rows.append(SummaryRow(variant=name, precision=name.rsplit("_", 1)[-1], state="unchanged"))
            continue
        rows.append(row_from_record(record, state="unchanged"))
    return rows


def failed_row(failure: FailedVariant) -> SummaryRow:
    return SummaryRow(variant=failure.name, precision=failure.precision, within=None, state="FAILED",
                      reason=failure.reason)


def next_commands(repository: Path, variants: Sequence[str], manifest: Path | None = None,
                  verify_models: Sequence[str] | None = None) -> tuple[str, ...]:
    """Serve the repository, check its answers, load it. `verify_models`: the models to verify (`--only`),
    every variant of each built; None: the whole manifest; empty: none. Without a manifest (build --onnx),
    verify reads each model from its variants' build.json."""
    if not variants:
        return ()
    commands = [f"trtbuild serve --repository {repository} --background"]
    if verify_models is None or verify_models:
        only = "".join(f" --only {m}" for m in verify_models or ())
        given = f" --manifest {manifest}" if manifest is not None else ""
        commands.append(f"trtbuild verify{given} --repository {repository}{only}")
    commands.append(perf_command(repository, variants))
    return tuple(commands)


def perf_command(repository: Path, variants: Sequence[str]) -> str:
    """perfclient on up to three variants that take the same request shapes (the first one's), with a
    `--shape` at the build's opt shape for each input whose dims the server leaves free: without it
    perfclient refuses a model with dynamic dims (a sequence length, an image size)."""
    shapes = {v: load_shapes(repository / v) for v in variants}
    first = shapes[variants[0]]
    chosen = [v for v in variants if shapes[v] == first][:3]
    flags = "".join(f" --shape {name}:{','.join(map(str, dims))}" for name, dims in first.items())
    return f"perfclient {' '.join(f'-m {v}' for v in chosen)} -u localhost:8001 --concurrency 8{flags}"


def _size(size: int | None) -> str:
    if size is None:
        return "-"
    return f"{size / 1e6:.1f} MB" if size >= 1e6 else f"{size / 1e3:.1f} kB"


def _seconds(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f} s"


def _ratio(ratio: float | None) -> str:
    """Throughput at the opt shape against FP32's (in-process, ONNX Runtime on this CPU)."""
    return "-" if ratio is None else f"{ratio:.2f}x"


def _serve(row: SummaryRow) -> str:
    if row.serve:
        return "yes"
    if row.worth_serving is False:
        return "not worth serving"
    # Met its tolerance, but its rounds overlap FP32's: no faster than FP32 that the measurement can tell; or
    # faster beyond them but by less than the margin a pick needs.
    if row.clearly_faster is not False or row.within is not True:
        return ""
    return f"under {PICK_MARGIN:.2f}x" if row.beyond_spread else "within noise"


def _runtimes(summary: BuildSummary) -> set[str]:
    return {r.runtime for r in summary.rows if r.runtime is not None}


def table(summary: BuildSummary, *, color: bool, limits: bool | None = None) -> Table:
    """The variants table; the runtime column only when variants differ in it (else the title names it).
    `limits`: cap the guard and state columns' widths, for a terminal too narrow for whole cells (default:
    with `color`)."""
    t = Table(box=box.SIMPLE_HEAD if color else box.ASCII2, show_edge=False, pad_edge=False, padding=(0, 1),
              header_style="bold" if color else "")
    with_runtime = len(_runtimes(summary)) > 1
    # Short columns never wrap; on a narrow terminal the accuracy, guard and state columns do.
    # (header, justify, min width, max width); the accuracy column gets what the others leave.
    columns: list[tuple[str, str, int | None, int | None]] = [("variant", "left", None, None),
                                                               ("prec", "left", None, None)]
    if with_runtime:
        columns.append(("runtime", "left", None, None))
    columns += [("size", "right", None, None), ("accuracy vs tolerance", "left", 20, None),
                ("kept in higher precision", "left", 11, 16), ("vs FP32", "right", None, None),
                ("serve", "left", None, None), ("time", "right", None, None), ("state", "left", 8, 28)]
    for name, justify, low, high in columns:
        # Width limits on a terminal only: the plain form (logs, narrow terminals) keeps every cell whole.
        t.add_column(name, justify=justify, no_wrap=low is None, min_width=low,  # type: ignore[arg-type]
                     max_width=high if (color if limits is None else limits) else None)
    for row in summary.rows:
        runtime = [row.runtime or "-"] if with_runtime else []
        if row.failed:
            # Cells are rich markup: a reason's "[batch, K, 6+]" would vanish as a tag unless escaped.
            t.add_row(escape(row.variant), row.precision, *runtime, "-", escape(row.reason or ""), "-", "-", "-", "-",
                      "FAILED",
                      style="red" if color else None)
            continue
        accuracy = row.accuracy + ("  (out of tolerance)" if row.within is False else "")
        t.add_row(escape(row.variant), row.precision, *runtime, _size(row.size_bytes), escape(accuracy),
                  escape(row.kept),
                  _ratio(row.speed_ratio), _serve(row), _seconds(row.seconds), escape(row.state),
                  style="dim" if color and row.state == "unchanged" else None)
    return t


_NARROW = 110  # terminal columns below which the table would lose columns
_PLAIN_MAX_WIDTH = 10_000  # the plain table's widest line (a measure, not a limit any real row reaches)


def render(summary: BuildSummary, stream: TextIO, *, color: bool | None = None) -> None:
    """Print the summary to `stream`; colour and box-drawing only on a terminal (or when `color`)."""
    tty = stream.isatty() if color is None else color
    console = Console(file=stream, force_terminal=tty, no_color=not tty, highlight=False, soft_wrap=False)
    if not tty or console.width < _NARROW:
        # Off a terminal (a log file) or on a narrow one, where rich would drop columns to fit: long lines
        # in plain characters, every column kept and every cell whole (one line per variant, which grep
        # finds with its whole failure reason): as wide as the table's widest row needs.
        tty = False
        needed = Console(width=_PLAIN_MAX_WIDTH).measure(table(summary, color=False)).maximum
        console = Console(file=stream, force_terminal=False, no_color=True, width=max(needed, 80), highlight=False)
    built = sum(1 for r in summary.rows if not r.failed)
    failed = len(summary.failures)
    title = f"{built} variant{'s' if built != 1 else ''} ready" + (f", {failed} FAILED" if failed else "")
    runtimes = _runtimes(summary)
    if len(runtimes) == 1:
        title += f" (runtime: {runtimes.pop()})"
    # Lines outside the table are never wrapped (a path breaks badly): soft_wrap.
    console.print(f"[bold]build summary[/]: {title}" if tty else f"build summary: {title}", markup=tty,
                  soft_wrap=True)
    variants = table(summary, color=tty, limits=False)
    if tty and console.measure(variants).maximum > console.width:
        # Too wide for whole cells: the guard and state columns wrap within limits, the accuracy gets the room.
        variants = table(summary, color=True, limits=True)
    console.print(variants)
    # Variants slower or larger than FP32: built and gated all the same, each with its figures; and those
    # whose rounds overlapped FP32's, with theirs.
    lines = [f"{r.variant} not worth serving: {r.worth_reason}" for r in summary.rows
             if not r.failed and r.worth_serving is False]
    lines += [f"{r.variant} within noise of FP32: {r.spread}" for r in summary.rows if _serve(r) == "within noise"]
    lines += [f"{r.variant} {r.speed_ratio:.3f}x FP32, under the {PICK_MARGIN:.2f}x a pick needs: {r.spread}"
              for r in summary.rows if _serve(r).startswith("under ") and r.speed_ratio is not None]
    lines.append(f"repository: {summary.repository}")
    if summary.report is not None:
        lines.append(f"report:     {summary.report}")
    if summary.log_file is not None:
        lines.append(f"build log:  {summary.log_file}")
    for i, command in enumerate(summary.next_commands):
        lines.append(f"{'next:' if i == 0 else '':<11} {command}")
    for line in lines:
        console.print(line, markup=False, soft_wrap=True)


def summarize(results: Sequence[ModelResult], specs: Sequence[ModelSpec], *, repository: Path,
              report: Path | None, log_file: Path | None, manifest: Path | None = None,
              failures: Sequence[FailedVariant] = (), whole_manifest: bool = True) -> BuildSummary:
    """The summary of one build: built variants from their results, unchanged ones from the build.json
    in the repository, failed ones with their reason; in manifest order. `whole_manifest`: `specs` are
    every model of `manifest` (not an `--only` subset), so a plain `trtbuild verify` checks just them."""
    by_name = {r.name: r for r in results}
    failed = {f.name: f for f in failures}
    rows: list[SummaryRow] = []
    for spec in specs:
        result = by_name.get(spec.name)
        built = {v.name: v for v in result.variants} if result is not None else {}
        for prec in spec.precisions:
            name = variant_name(spec.name, prec)
            if name in failed:
                rows.append(failed_row(failed[name]))
            elif name in built:
                rows.append(replace(row_from_record(built[name].to_json(), state="rebuilt"), model=spec.name))
            elif result is not None and (result.status is ModelStatus.UNCHANGED or name in result.unchanged):
                rows.extend(replace(r, model=spec.name) for r in unchanged_rows(repository, [name]))
    rows = with_recommendation(rows)
    ready = [r.variant for r in rows if not r.failed]
    # `trtbuild verify` fails on a variant it does not find: it is proposed for the models built whole.
    whole = [spec.name for spec in specs if all(variant_name(spec.name, p) in ready for p in spec.precisions)]
    # Without a manifest (build --onnx) verify reads the models from their build.json: name them.
    verify = None if manifest is not None and whole_manifest and len(whole) == len(specs) else whole
    return BuildSummary(tuple(rows), repository, report, log_file, next_commands(repository, ready, manifest, verify))
