"""Precision variants of an FP32 ONNX model: FP16 (ModelOpt autocast) and INT8 (ModelOpt PTQ, Q/DQ).

The Q/DQ ONNX is the portable artifact: TensorRT builds it strongly typed on a GPU, ONNX Runtime
runs it on a CPU. Calibration is the slow part, so its result is cached by everything it depends on.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from numpy.typing import NDArray
from onnx import version_converter

from builder.errors import OnnxModelError, ToolError, tool_cause
from builder.repository import onnx_files
from builder.runtimes.base import feeds as sample_feeds
from builder.runtimes.onnxruntime import ORT_ERRORS
from builder.spec.enums import CalibrationMethod, Int8Recipe
from builder.spec.model import CalibrationSpec
from builder.spec.settings import default_cache_dir
from builder.steps import (
    calibration_order,
    fp16_ranges,
    int8_recipe,
    onnx_model,
    ort_calibration,
    qdq_mix,
    resources,
)
from builder.steps.int8_recipe import CPU_RUNTIME
from common import progress

log = logging.getLogger(__name__)

# Bump when the way a variant is produced changes, so caches and repositories rebuild.
RECIPE_VERSION = "3"  # 3: FP16 fallback repairs, INT8 as given / recipe fallback; 2: min/max shape levels
# The same for FP16 alone (its variant's build key, not the other variants').
FP16_VERSION = "2"  # 2: autocast sees 4 single samples
# The same for INT8 alone (its calibrations and its variant's build key, not the other variants').
INT8_VERSION = "3"  # 2: the sample ModelOpt's entropy calibration sees first; guard candidates derived;
# 3: auto's CNN form on the CPU is ONNX Runtime's default op types, depthwise Conv included


@dataclass(frozen=True)
class CalibrationResult:
    recipe: Int8Recipe
    method: CalibrationMethod
    samples: int
    cache_key: str
    cached: bool  # reused from the calibration cache
    quantize_linear_nodes: int  # QuantizeLinear, or DynamicQuantizeLinear for dynamic quantization
    settings: dict[str, object]  # the tool and the options it ran with, as recorded in build.json
    # The settings the recipe that made it ran with (the recipe chosen for "auto", its op types and the nodes it
    # left in float): what the accuracy guard's candidates are quantized with. None: nothing was quantized.
    spec: CalibrationSpec | None = None


@dataclass(frozen=True)
class OrtForm:
    """The integer types ONNX Runtime's static recipe writes, by the runtime that runs the graph."""

    activations: str  # QuantType member name
    weights: str
    symmetric_activations: bool

    def activations_text(self) -> str:
        return f"{self.activations} ({'symmetric' if self.symmetric_activations else 'asymmetric'})"

    def record(self) -> str:
        return f"activations {self.activations_text()}, weights {self.weights} (symmetric)"


def ort_form(runtime: str) -> OrtForm:
    """U8S8 for ONNX Runtime on the CPU (the form its kernels fuse); symmetric S8S8 elsewhere: TensorRT (and ONNX
    Runtime's TensorRT provider on a GPU) takes only int8 Q/DQ with zero points of 0."""
    if runtime == CPU_RUNTIME:
        return OrtForm("QUInt8", "QInt8", False)
    return OrtForm("QInt8", "QInt8", True)


# Failures of the tools a variant is made with (ModelOpt and ONNX Runtime's quantizer, which run ONNX Runtime
# itself, not the reference executor: hence ORT_ERRORS here) that mean "this model or these settings do not work
# with it": they become one line naming a log file with the tool's full output, but only when a tool
# raised them (raised_by_tool): the same types raised by our own code are bugs. Any other exception
# is a bug (ours or the tool's) and keeps its traceback.
TOOL_ERRORS: tuple[type[BaseException], ...] = (
    RuntimeError, ValueError, AssertionError, OSError, onnx.checker.ValidationError,
    onnx.shape_inference.InferenceError, *ORT_ERRORS,
)
# The tools, by top-level package; our own code, likewise ("__main__": the quantizer subprocess).
_TOOL_PACKAGES = frozenset({"modelopt", "onnxruntime", "onnx", "onnxconverter_common"})
_OUR_PACKAGES = frozenset({"builder", "client", "__main__"})


def raised_by_tool(exc: BaseException) -> bool:
    """Whether `exc` was raised inside a tool's code: of the frames it passed through, from where it was
    raised outwards, the first that is a tool's or ours decides (frames of other libraries, numpy or the
    standard library, are skipped: they were called by one or the other). A callback of ours that the tool
    called is ours."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        package = str(frame.f_globals.get("__name__", "")).partition(".")[0]
        if package in _OUR_PACKAGES:
            return False
        if package in _TOOL_PACKAGES:
            return True
    return False


# A tool's code naming a module it could not import: ModelOpt imports tensorrt where it can and calls it
# anyway for graphs with custom ops (com.microsoft): "name 'trt' is not defined". The tool cannot handle this
# graph here (a missing optional dependency), which is a tool failure like TOOL_ERRORS, not a bug of ours.
MISSING_DEPENDENCY_ERRORS: tuple[type[BaseException], ...] = (NameError, ImportError)


def _is_tool_failure(exc: BaseException) -> bool:
    """A TOOL_ERRORS type, ModelOpt's bare Exception ("ONNX Runtime failed", the reason in its log), or a
    missing optional dependency (MISSING_DEPENDENCY_ERRORS), raised by a tool."""
    return (isinstance(exc, (*TOOL_ERRORS, *MISSING_DEPENDENCY_ERRORS)) or type(exc) is Exception) \
        and raised_by_tool(exc)


def _dependency_hint(exc: BaseException) -> str:
    """Where a tool failed for want of a module it imports optionally, which one (said after the cause)."""
    if isinstance(exc, NameError) and exc.name == "trt":
        return " (ModelOpt calls TensorRT for graphs with custom ops; TensorRT is not installed here)"
    if isinstance(exc, ImportError) and exc.name:
        return f" (the tool needs the module {exc.name!r}, not installed here)"
    return ""


# The ONNX Runtime quantizer runs in a subprocess; a calibration that takes longer is stuck.
QUANTIZER_TIMEOUT_S = float(os.environ.get("TRTBUILD_QUANTIZER_TIMEOUT_S", "3600"))


def failure_log(what: str, output: str, exc: BaseException | None, *, log_file: Path | None) -> Path | str:
    """Write a tool's captured output (and the exception's traceback) where the one-line error names it:
    the build log `log_file` where the build keeps one (BuildOptions.log_file), else a file of its own under
    the cache; where no log can be written, say why instead (the tool's failure is the error to report)."""
    trace = "".join(traceback.format_exception(exc)) if exc is not None else ""
    text = f"{what}\n\n--- tool output ---\n{output}\n--- exception ---\n{trace}"
    build_log = log_file
    if build_log is not None:
        try:
            with build_log.open("a", encoding="utf-8") as stream:
                stream.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} failure: {text}\n")
            return build_log
        except OSError:
            log.debug("build log %s not writable; writing the tool's output to a log of its own", build_log)
    folder = default_cache_dir() / "logs"
    path = folder / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', what)}.log"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as error:
        return f"not written: {error.strerror or error}"
    return path


@contextlib.contextmanager
def _quiet() -> Iterator[io.StringIO]:
    """ModelOpt and ORT's calibrator print progress bars; keep them out of the user's terminal and in
    the sink (written to a log file when the step fails). ModelOpt's own logging is restored after."""
    sink = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        warnings.simplefilter("ignore")
        import modelopt.onnx  # noqa: F401 - its import installs a stdout handler; replace it below

        # ModelOpt binds a handler to sys.stdout at import; send its records to the sink instead
        # and keep them from reaching the root logger twice.
        mo_log = logging.getLogger("modelopt.onnx")
        saved = (mo_log.propagate, mo_log.handlers[:])
        mo_log.propagate = False
        for handler in saved[1]:
            mo_log.removeHandler(handler)
        sink_handler = logging.StreamHandler(sink)
        mo_log.addHandler(sink_handler)
        # Parts of ModelOpt log through the root logger (e.g. ops it cannot convert to FP16).
        root_filter = _ModeloptRootFilter(sink)
        logging.getLogger().addFilter(root_filter)
        try:
            yield sink
        finally:
            logging.getLogger().removeFilter(root_filter)
            mo_log.removeHandler(sink_handler)
            mo_log.propagate = saved[0]
            for handler in saved[1]:
                mo_log.addHandler(handler)
    if sink.getvalue():
        log.debug("modelopt output:\n%s", sink.getvalue()[-4000:])


class _ModeloptRootFilter(logging.Filter):
    def __init__(self, sink: io.StringIO) -> None:
        super().__init__()
        self.sink = sink

    def filter(self, record: logging.LogRecord) -> bool:
        if "modelopt" in record.pathname:
            self.sink.write(f"{record.levelname} {record.getMessage()}\n")
            return False
        return True


# ModelOpt autocast's own defaults: a node whose inputs or outputs exceed data_max on the calibration
# feeds, or whose initializers exceed init_max, stays in FP32.
FP16_DATA_MAX = 512.0
FP16_INIT_MAX = 65504.0
# Autocast runs the FP32 graph once per feed to see each tensor's range, and holds every tensor of every feed
# until it decides: its memory grows with the samples it sees. Measured on PP-OCRv4 rec (11 MB, 48x320 inputs):
# 16 samples in 2 feeds of 8 peaked at 6.9 GB, 8 single samples at 2.6 GB, 4 at 1.8 GB, with the same nodes kept
# in FP32. So a few single samples (the gate then measures the FP16 graph on all the data).
AUTOCAST_FEEDS = 4
AUTOCAST_BATCH = 1  # samples per feed for a batching model


@dataclass(frozen=True)
class Fp16Settings:
    """What autocast keeps in FP32 (its levers): named nodes, whole op types, and the nodes whose data or
    initializers exceed the thresholds."""

    nodes_to_exclude: tuple[str, ...] = ()  # exact node names
    op_types_to_exclude: tuple[str, ...] = ()
    data_max: float = FP16_DATA_MAX
    init_max: float = FP16_INIT_MAX

    def record(self) -> dict[str, object]:
        return {"tool": "modelopt.onnx.autocast", "keep_io_types": True, "data_max": self.data_max,
                "init_max": self.init_max, "nodes_to_exclude": list(self.nodes_to_exclude),
                "op_types_to_exclude": list(self.op_types_to_exclude)}


Feed = dict[str, NDArray[Any]]


def autocast_feeds(sets: Sequence[Mapping[str, NDArray[Any]]], batch_size: int | None, *,
                   limit: int = AUTOCAST_FEEDS) -> list[Feed]:
    """Feeds for autocast's reference run, each exactly as the model takes it (batches of `batch_size`
    samples, or whole samples for a model that does not batch: runtimes.base.feeds), at most `limit`, taken
    evenly from every set (e.g. the min, opt and max shapes) so each one's ranges are seen."""
    per_set = [list(sample_feeds(one, batch_size)) for one in sets if one]
    chosen: list[Feed] = []
    quota = max(1, limit // max(1, len(per_set)))
    for feeds in per_set:
        step = max(1, len(feeds) / quota)
        chosen.extend(feeds[int(i * step)] for i in range(min(quota, len(feeds))))
    return chosen


# ModelOpt copies each shared initializer once per consumer before FP16 conversion and INT8 quantization. Where
# that would add more than this, or more than the model's own size, the constants stay shared: captcha_crnn's
# unrolled LSTM (two 6.5 MB weights, 20 readers each) went from 19 MB to 270 MB, and the conversions then copied
# that graph several times (peaks of 2.2 GB for FP16 and 3.2 GB for INT8). Autocast's converter tracks each
# initializer's consumers by itself (one copy per precision they need); the quantizer then puts one Q/DQ on a
# shared weight. Every other corpus model adds far less, so its graphs are as before.
DUPLICATION_LIMIT = 64 << 20
_sanitizer_lock = threading.Lock()


def duplicates_shared_constants(fp32_path: Path) -> bool:
    """Whether ModelOpt may copy `fp32_path`'s shared constants per consumer (see DUPLICATION_LIMIT)."""
    stat = fp32_path.stat()
    growth, own = _constant_bytes(str(fp32_path.resolve()), (stat.st_ino, stat.st_mtime_ns, stat.st_ctime_ns,
                                                             stat.st_size))
    if growth <= max(DUPLICATION_LIMIT, own):
        return True
    log.debug("%s: shared constants stay shared (copying them per consumer would add %.0f MB to %.0f MB)",
              fp32_path.name, growth / 1e6, own / 1e6)
    return False


@functools.lru_cache(maxsize=16)
def _constant_bytes(path: str, version: tuple[int, ...]) -> tuple[int, int]:
    """(what per-consumer copies would add, the initializers' own bytes) of the graph at `path`, as it was when
    its inode, times and size were `version` (the guard quantizes one graph many times: it is read once)."""
    model = onnx.load(path, load_external_data=False)
    own = sum(onnx_model.initializer_bytes(tensor) for tensor in model.graph.initializer)
    return onnx_model.shared_constant_growth(model), own


@contextlib.contextmanager
def _shared_constants_kept(keep: bool) -> Iterator[None]:
    """Autocast without its sanitizer's per-consumer copies of shared constants, for the duration, when `keep`."""
    if not keep:
        yield
        return
    from modelopt.onnx.autocast.graphsanitizer import GraphSanitizer

    with _sanitizer_lock:
        original = GraphSanitizer.duplicate_shared_constants
        GraphSanitizer.duplicate_shared_constants = lambda self: None
        try:
            yield
        finally:
            GraphSanitizer.duplicate_shared_constants = original


def to_fp16(fp32_path: Path, out_path: Path, *, feeds: Sequence[Mapping[str, NDArray[Any]]], what: str,
            settings: Fp16Settings = Fp16Settings(), log_file: Path | None) -> dict[str, object]:
    """FP16 compute with FP32 inputs and outputs, so clients and configs stay unchanged.

    `feeds` (the user's samples, or synthetic ones at real shapes) are what autocast measures tensor
    ranges on: without them it runs the graph on random inputs with every dynamic dim set to 1, which
    breaks models with dynamic spatial dims (a Concat of feature maps) and misjudges ranges."""
    if not feeds:
        raise AssertionError("to_fp16 needs feeds: autocast must not guess the inputs")
    fp32_path = fp32_path.resolve()
    # The tool runs in the temporary folder: ONNX Runtime's symbolic shape inference, which ModelOpt calls, writes
    # sym_shape_infer_temp.onnx and its weights into the working directory when it cannot finish
    # (an ai.onnx.ml node, for one).
    with tempfile.TemporaryDirectory(prefix="trtbuild-fp16-") as tmp, _quiet() as sink:
        from modelopt.onnx.autocast import convert_to_mixed_precision

        # A folder of .npz files is autocast's multi-batch form: one reference run per file.
        feed_dir = Path(tmp) / "feeds"
        feed_dir.mkdir()
        for index, feed in enumerate(feeds):
            np.savez(feed_dir / f"{index:05d}.npz", **feed)
        try:
            keep_shared = not duplicates_shared_constants(fp32_path)
            with contextlib.chdir(tmp), fp16_ranges.streaming(), _shared_constants_kept(keep_shared):
                model = convert_to_mixed_precision(
                    str(fp32_path), low_precision_type="fp16", keep_io_types=True, calibration_data=str(feed_dir),
                    nodes_to_exclude=[f"^{re.escape(n)}$" for n in settings.nodes_to_exclude] or None,
                    op_types_to_exclude=list(settings.op_types_to_exclude) or None,
                    data_max=settings.data_max, init_max=settings.init_max)
        except Exception as exc:
            # ModelOpt raises a bare Exception when ONNX Runtime cannot run the graph (the reason is in
            # its log): a tool failure like TOOL_ERRORS. Subclasses of Exception outside TOOL_ERRORS are bugs.
            if not _is_tool_failure(exc):
                raise
            output = sink.getvalue()
            record = failure_log(f"fp16 {what}", output, exc, log_file=log_file)
            raise ToolError(f"{what}: FP16 conversion (ModelOpt autocast) failed: "
                            f"{tool_cause(exc, output, hide={fp32_path: 'the model', Path(tmp): 'its feeds'})}"
                            f"{_dependency_hint(exc)} (full output: {record})") from exc
    # Autocast's shape annotations can hold the shapes of the feeds it ran on: ONNX Runtime plans buffers by
    # them and fails at other shapes ("Shape mismatch attempting to re-use buffer"). Inferred again instead.
    onnx_model.dedupe_initializers(model)
    onnx_files.save(onnx_model.refresh_value_info(model), out_path)
    onnx_files.load(out_path)
    return settings.record()


def calibration_key(fp32_sha: str, data_digest: str, spec: CalibrationSpec, runtime: str = CPU_RUNTIME) -> str:
    payload = {
        "onnx": fp32_sha,
        "data": data_digest,
        "method": spec.method,
        "recipe": spec.recipe,
        "op_types_to_quantize": list(spec.op_types_to_quantize),
        "nodes_to_exclude": list(spec.nodes_to_exclude),
        "nodes_to_quantize": list(spec.nodes_to_quantize),
        # ONNX Runtime's static recipe writes other types for other runtimes (ort_form).
        "form": ort_form(runtime).record() if spec.recipe is Int8Recipe.ONNXRUNTIME else None,
        "modelopt": version("nvidia-modelopt"),
        "onnxruntime": version("onnxruntime"),
        "recipe_version": RECIPE_VERSION,
        "int8_version": INT8_VERSION,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def to_int8(
    fp32_path: Path,
    *,
    fp32_sha: str,
    calibration: Mapping[str, NDArray[Any]],
    data_digest: str,
    spec: CalibrationSpec,
    out_path: Path,
    cache_dir: Path,
    what: str = "",
    runtime: str = CPU_RUNTIME,
    log_file: Path | None,
) -> CalibrationResult:
    """INT8 by post-training quantization (ModelOpt's Q/DQ, ONNX Runtime's static Q/DQ or its dynamic
    quantization); reuses a cached result. `runtime` (a Runtime.name) is what will run the graph: it decides the
    recipe for "auto" (steps/int8_recipe.py) and the integer types of ONNX Runtime's static recipe. `what` names
    the model in errors (default: the file's name); a tool's full output goes to `log_file` (failure_log).

    Where ModelOpt fails on the model (a graph its loader rejects, custom ops it hands to TensorRT), ONNX
    Runtime's static recipe is tried instead; where a recipe chosen for "auto" fails, ModelOpt's: each with one
    warning line; build.json records which ran and why."""
    what = what or fp32_path.name
    quantized = already_quantized(fp32_path)
    if quantized is not None:
        # Nothing left to calibrate: the INT8 variant is the model as given (the gate and the speed check
        # still judge it), said in one line and recorded.
        log.warning("%s: the model is already quantized (%s); the INT8 variant is the model as given (the FP32 "
                    "graph itself)", what, quantized)
        onnx_files.copy_model(fp32_path, out_path)
        return CalibrationResult(spec.recipe, spec.method, 0, "", False, 0,
                                 {"tool": None, "as_given": True, "why": f"already quantized ({quantized})"})
    graph = onnx.load(str(fp32_path), load_external_data=False)
    choice = int8_recipe.choose(graph, spec.recipe, runtime)
    chosen = int8_recipe.apply(choice, spec)
    del graph
    if choice.chosen:
        log.info("%s: %s", what, choice.line())

    def quantize(with_spec: CalibrationSpec) -> CalibrationResult:
        result = _to_int8(fp32_path, fp32_sha=fp32_sha, calibration=calibration, data_digest=data_digest,
                          spec=with_spec, out_path=out_path, cache_dir=cache_dir, what=what, runtime=runtime,
                          log_file=log_file)
        return replace(result, settings={**result.settings, "recipe_choice": choice.record()})

    try:
        return quantize(chosen)
    except QuantizationFailed as exc:
        if chosen.recipe is Int8Recipe.MODELOPT:
            fallback = replace(spec, recipe=Int8Recipe.ONNXRUNTIME)
        elif choice.chosen:  # a recipe chosen for "auto" failed: ModelOpt's, the one "auto" took before
            fallback = replace(spec, recipe=Int8Recipe.MODELOPT)
        else:
            raise
        first = exc
    log.debug("%s; trying %s", first, _RECIPE_NAMES[fallback.recipe])
    why = reason(first, what)
    try:
        result = quantize(fallback)
    except QuantizationFailed as exc:
        second = reason(exc, what)
        raise ToolError(f"{what}: {why}; {_RECIPE_NAMES[fallback.recipe]} (INT8) neither: {second} "
                        f"(full output: {exc.record})") from exc
    log.warning("%s: %s; the INT8 variant is %s instead", what, why, _RECIPE_NAMES[fallback.recipe])
    return replace(result, settings={**result.settings, "instead_of": _TOOLS[chosen.recipe], "why": why})


_RECIPE_NAMES = {Int8Recipe.MODELOPT: "ModelOpt's recipe", Int8Recipe.ONNXRUNTIME: "ONNX Runtime's recipe",
                 Int8Recipe.ONNXRUNTIME_DYNAMIC: "ONNX Runtime's dynamic quantization"}
_TOOLS = {Int8Recipe.MODELOPT: "modelopt.onnx.quantization",
          Int8Recipe.ONNXRUNTIME: "onnxruntime.quantization.quantize_static",
          Int8Recipe.ONNXRUNTIME_DYNAMIC: "onnxruntime.quantization.quantize_dynamic"}

# Ops that compute in integers (dynamic or static quantization already applied), and the float ops INT8 targets.
_QUANTIZED_OPS = frozenset({"ConvInteger", "MatMulInteger", "QLinearConv", "QLinearMatMul", "DynamicQuantizeLSTM",
                            "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QGemm", "QAttention"})
_FLOAT_COMPUTE_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm", "LSTM", "GRU", "Attention", "Einsum",
                                "FusedMatMul"})
# Ops between a DequantizeLinear and the compute op it feeds in Q/DQ graphs (a weight's layout change).
_DQ_PATH = frozenset({"Transpose", "Reshape", "Cast", "Identity", "Unsqueeze", "Squeeze", "Flatten"})


def already_quantized(fp32_path: Path) -> str | None:
    """What makes the graph an already quantized one, in words; None otherwise (subgraphs included): integer
    compute ops with no float Conv/MatMul/Gemm left to quantize, or Q/DQ, i.e. float compute ops that take
    DequantizeLinear outputs (their weights or activations quantized by whoever made the model: quantizing
    again would stack a second Q/DQ on the first)."""
    model = onnx.load(str(fp32_path), load_external_data=False)
    nodes = list(onnx_model.all_nodes(model.graph))
    counts = Counter(node.op_type for node in nodes)
    integer = {op: n for op, n in counts.items() if op in _QUANTIZED_OPS}
    if integer and not any(op in _FLOAT_COMPUTE_OPS for op in counts):
        return f"{_listed(integer)}, no float Conv/MatMul/Gemm left"
    producers = {out: node for node in nodes for out in node.output if out}

    def dequantized(tensor: str) -> bool:
        for _ in range(8):
            node = producers.get(tensor)
            if node is None:
                return False
            if node.op_type == "DequantizeLinear":
                return True
            if node.op_type not in _DQ_PATH or not node.input:
                return False
            tensor = node.input[0]
        return False

    compute = [node for node in nodes if node.op_type in _FLOAT_COMPUTE_OPS]
    fed = [node for node in compute if any(dequantized(t) for t in node.input if t)]
    if not fed:
        return None
    return (f"Q/DQ: {counts['QuantizeLinear']} QuantizeLinear, {counts['DequantizeLinear']} DequantizeLinear; "
            f"{len(fed)} of {len(compute)} {'/'.join(sorted({n.op_type for n in compute}))} take dequantized inputs")


def integer_compute(fp32_path: Path) -> str | None:
    """The integer compute ops its exporter put in the graph (subgraphs included), in words, where there are any,
    also beside float ones (kokoro's TTS: 148 MatMulInteger and 87 ConvInteger, with 26 float MatMul left); None
    without any."""
    model = onnx.load(str(fp32_path), load_external_data=False)
    counts = Counter(node.op_type for node in onnx_model.all_nodes(model.graph) if node.op_type in _QUANTIZED_OPS)
    return _listed(counts) if counts else None


def _listed(counts: Mapping[str, int]) -> str:
    """Op counts in words, the most frequent first: "148 MatMulInteger, 87 ConvInteger"."""
    return ", ".join(f"{n} {op}" for op, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def reason(exc: BaseException, what: str) -> str:
    """A tool failure's one-line message without the model's name and the log it names, for a message that names
    them once (a fallback's "why", or two failures in one line)."""
    return re.sub(r"\.? \(full output: [^()]*\)$", "", str(exc).removeprefix(f"{what}: "))


class QuantizationFailed(ToolError):
    """The quantizer failed on this model (its output is in `record`)."""

    def __init__(self, message: str, record: Path | str) -> None:
        super().__init__(message)
        self.record = record


def _to_int8(fp32_path: Path, *, fp32_sha: str, calibration: Mapping[str, NDArray[Any]], data_digest: str,
             spec: CalibrationSpec, out_path: Path, cache_dir: Path, what: str, runtime: str,
             log_file: Path | None) -> CalibrationResult:
    key = calibration_key(fp32_sha, data_digest, spec, runtime)
    samples = len(next(iter(calibration.values())))
    settings: dict[str, object] = {
        "recipe": spec.recipe,
        "method": spec.method,
        "samples": samples,
        "op_types_to_quantize": list(spec.op_types_to_quantize) or "default",
        "nodes_to_exclude": list(spec.nodes_to_exclude),
    }
    if spec.recipe is Int8Recipe.MODELOPT:
        settings.update(tool=_TOOLS[spec.recipe], high_precision_dtype="fp32", calibration_eps=["cpu"])
    elif spec.recipe is Int8Recipe.ONNXRUNTIME:
        form = ort_form(runtime)
        settings.update(tool=_TOOLS[spec.recipe], format="QDQ", per_channel=True, runtime=runtime,
                        activations=form.activations_text(), weights=f"{form.weights} (symmetric)")
    elif spec.recipe is Int8Recipe.ONNXRUNTIME_DYNAMIC:
        # No calibration: activations are quantized at run time (the samples still key the cache and gate it).
        settings.update(tool=_TOOLS[spec.recipe], per_channel=True, weights="QInt8 (symmetric, per channel)",
                        activations="QUInt8, quantized at run time", gemm_as_matmul=True)
        settings.pop("method")
    else:
        raise AssertionError(f"INT8 recipe {spec.recipe} reached the quantizer unresolved")
    cached = cache_dir / "calibration" / f"{key}.onnx"
    # What the calibration had to say (values beyond its first pass's range), kept beside the cached graph so
    # that a rebuild from the cache says it too.
    noted = cached.with_suffix(".note.txt")
    if cached.is_file():
        log.debug("INT8: reusing calibration %s (inputs unchanged)", key[:12])
        onnx_files.copy_model(cached, out_path)
        if noted.is_file():
            settings["calibration_note"] = _said(noted.read_text().strip())
        return CalibrationResult(spec.recipe, spec.method, samples, key, True, _count_q(out_path), settings, spec)
    note: str | None = None
    warnings_after: list[str] = []  # logged once the tools' output is no longer redirected (_quiet)
    log.debug("INT8: calibrating on %d samples (%s, %s recipe)", samples, spec.method, spec.recipe)
    with progress.task(f"INT8 calibration: {samples} samples, {spec.method}, {spec.recipe}"), \
            tempfile.TemporaryDirectory(prefix="trtbuild-int8-") as tmp, _quiet() as sink:
        fp32_path = fp32_path.resolve()
        tmp_out = Path(tmp) / "int8.onnx"
        try:
            # In the temporary folder: see to_fp16 (files ONNX Runtime's shape inference leaves behind).
            with contextlib.chdir(tmp):
                if spec.recipe is not Int8Recipe.MODELOPT:
                    note = _quantize_ort(fp32_path, calibration, spec, Path(tmp), tmp_out, runtime)
                else:
                    _quantize_modelopt(fp32_path, calibration, spec, tmp_out)
        except Exception as exc:
            # As in to_fp16: a bare Exception is ModelOpt's "ONNX Runtime failed"; other types are bugs.
            # QuantizerFailed is the subprocess's tool failure (it decided by the same rule).
            if not (isinstance(exc, QuantizerFailed) or _is_tool_failure(exc)):
                raise
            output = sink.getvalue() + (exc.output if isinstance(exc, QuantizerFailed) else "")
            record = failure_log(f"int8 {spec.recipe} {what}", output, exc, log_file=log_file)
            cause = tool_cause(exc, output, hide={fp32_path: "the model", Path(tmp): "its work folder"})
            raise QuantizationFailed(f"{what}: INT8 calibration ({spec.recipe}) failed: {cause} "
                                     f"(full output: {record})", record) from exc
        try:
            quantized = onnx_files.load(tmp_out)
        except OnnxModelError as exc:
            # The tool wrote a graph the ONNX checker refuses (ONNX Runtime's quantizer on silero VAD's If
            # subgraphs: a node before the one whose output it reads): the recipe failed, so "auto" falls back.
            record = failure_log(f"int8 {spec.recipe} {what}", sink.getvalue(), exc, log_file=log_file)
            raise QuantizationFailed(f"{what}: INT8 calibration ({spec.recipe}) wrote a graph the ONNX checker "
                                     f"refuses: {tool_cause(exc, '', hide={Path(tmp): 'its work folder'})} "
                                     f"(full output: {record})", record) from exc
        qdq = sum(1 for n in quantized.graph.node if n.op_type in _QUANTIZE_OPS)
        if onnx_model.dedupe_initializers(quantized):  # one copy of a weight the recipe quantized per consumer
            onnx_files.save(quantized, tmp_out)
        del quantized
        if qdq == 0 and not spec.nodes_to_quantize:
            hint = " (ModelOpt skips GEMV-shaped and small MatMuls)" if spec.recipe is Int8Recipe.MODELOPT else ""
            warnings_after.append(f"INT8: {spec.recipe} quantized no node of {fp32_path.name}{hint}; the int8 "
                                  "variant computes in FP32")
        # With the data file ModelOpt writes beside a model over 2 GB.
        cached.parent.mkdir(parents=True, exist_ok=True)
        if note is not None:
            noted.write_text(note + "\n")
        else:  # a note left by an earlier calibration of this key that did not reach the cache
            noted.unlink(missing_ok=True)
        prepared = Path(tmp) / _ORT_PREPARED
        if prepared.is_file():  # before the Q/DQ graph: a reader finding that finds this too
            onnx_files.copy_model(prepared, float_graph(cache_dir, key))
        onnx_files.copy_model(tmp_out, cached)
        onnx_files.copy_model(tmp_out, out_path)
    for line in warnings_after:
        log.warning("%s", line)
    if note is not None:
        settings["calibration_note"] = _said(note)
    return CalibrationResult(spec.recipe, spec.method, samples, key, False, qdq, settings, spec)


def _said(note: str) -> str:
    """A calibration note, logged (on the terminal and in the build log) and returned for build.json."""
    log.warning("INT8 calibration (ONNX Runtime): %s", note)
    return note


# What a quantized graph's quantized tensors are counted by: static Q/DQ's, dynamic quantization's.
_QUANTIZE_OPS = frozenset({"QuantizeLinear", "DynamicQuantizeLinear"})


# The graph ONNX Runtime's quantizer calibrates and quantizes: the FP32 graph after its pre-processing.
_ORT_PREPARED = "prepared.onnx"


def float_graph(cache_dir: Path, key: str) -> Path:
    """Where a calibration's float graph is kept beside its Q/DQ graph, where the quantizer changed the graph
    before quantizing it (ONNX Runtime's pre-processing): the INT8 guard derives its candidates from both."""
    return cache_dir / "calibration" / f"{key}.float.onnx"


def _count_q(path: Path) -> int:
    model = onnx.load(str(path), load_external_data=False)
    return sum(1 for n in model.graph.node if n.op_type in _QUANTIZE_OPS)


def _quantize_modelopt(fp32_path: Path, calibration: Mapping[str, NDArray[Any]], spec: CalibrationSpec,
                       out: Path) -> None:
    from modelopt.onnx.quantization import quantize

    whole = _whole_samples(fp32_path, calibration)
    if spec.method is CalibrationMethod.ENTROPY:
        calibration = entropy_order(fp32_path, calibration, whole=whole)
    def run(duplicate: bool) -> None:
        quantize(
            str(fp32_path),
            quantize_mode="int8",
            calibration_data=None if whole else dict(calibration),
            # A model that does not batch (max_batch_size 0): ModelOpt would split the arrays by the input's
            # first dim, so it gets each sample whole from a reader instead.
            calibration_data_reader=_WholeSamples(calibration) if whole else None,
            calibration_method=spec.method,
            calibration_eps=["cpu"],
            # FP32 between Q/DQ pairs: the FP16 default loses accuracy badly under ONNX Runtime
            # on CPU (measured: 6 % top-1 agreement vs 88 %), and TensorRT fuses either.
            high_precision_dtype="fp32",
            op_types_to_quantize=list(spec.op_types_to_quantize) or None,
            nodes_to_exclude=list(spec.nodes_to_exclude) or None,
            nodes_to_quantize=list(spec.nodes_to_quantize) or None,
            output_path=str(out),
            # Weights kept beside the model (over 2 GB): ModelOpt writes its result the same way (it decides
            # by itself only from the size of what it loaded).
            use_external_data_format=onnx_files.has_external_data(fp32_path),
            enable_shared_constants_duplication=duplicate,
            log_level="WARNING",
        )

    # Node choices (the guard's candidates, a user's exclusions) keep ModelOpt's copies: ONNX Runtime's quantizer
    # points every reader of a shared weight at its quantized form, excluded or not.
    duplicate = (bool(spec.nodes_to_exclude or spec.nodes_to_quantize)
                 or duplicates_shared_constants(fp32_path))
    run(duplicate)
    if duplicate:
        return
    if leak := shared_weight_leak(out):
        # ONNX Runtime's quantizer points every reader of a shared weight at its quantized copy, so a node left
        # unquantized (by the guard, or by ModelOpt's own rules) would read INT8-rounded weights: the copies
        # are made after all for this model.
        log.debug("%s: %s; quantizing again with ModelOpt's per-consumer copies", fp32_path.name, leak)
        run(True)
        return
    split_shared_qdq(out)


def split_shared_qdq(path: Path) -> int:
    """Give each reader of a shared weight's QuantizeLinear -> DequantizeLinear pair a pair of its own (reading the
    same weight, scale and zero point), in place: the Q/DQ structure ModelOpt writes when it copies shared
    constants per consumer (one pair per weight input, as TensorRT and ONNX Runtime's fusions expect), without the
    copies. The pairs added."""
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    constants = {t.name for t in graph.initializer}
    made_by = {o: n for n in graph.node for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    added: list[onnx.NodeProto] = []
    for dq in [n for n in graph.node if n.op_type == "DequantizeLinear"]:
        q = made_by.get(dq.input[0])
        users = list({id(u): u for u in readers.get(dq.output[0], [])}.values())  # a node reading it twice: once
        if (q is None or q.op_type != "QuantizeLinear" or len(users) < 2
                or not all(name in constants for name in (*q.input, *dq.input[1:]) if name)):
            continue  # the copies go first in the graph: everything they read must be an initializer
        if any(o.name == dq.output[0] for o in graph.output):
            continue
        for k, user in enumerate(users[1:], start=1):
            q_copy, dq_copy = onnx.NodeProto(), onnx.NodeProto()
            q_copy.CopyFrom(q)
            dq_copy.CopyFrom(dq)
            q_copy.name, q_copy.output[0] = f"{q.name}_{k}", f"{q.output[0]}_{k}"
            dq_copy.name, dq_copy.output[0] = f"{dq.name}_{k}", f"{dq.output[0]}_{k}"
            dq_copy.input[0] = q_copy.output[0]
            for index, name in enumerate(user.input):
                if name == dq.output[0]:
                    user.input[index] = dq_copy.output[0]
            added.extend((q_copy, dq_copy))
    if not added:
        return 0
    nodes = [*added, *graph.node]  # they read initializers only: first is a topological place
    del graph.node[:]
    graph.node.extend(nodes)
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in graph.initializer):
        onnx.save(model, str(path))  # the weights stay in the file ModelOpt wrote beside it, referred to as before
    else:
        onnx_files.save(model, path)
    return len(added) // 2


_LAYOUT_OPS = frozenset({"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Cast"})


def shared_weight_leak(path: Path, excluded: Sequence[str] = ()) -> str | None:
    """A node of the Q/DQ graph at `path` that reads a dequantized weight which other nodes read too, while it is
    not itself quantized (an activation input not from a DequantizeLinear) or is one of `excluded`; None when
    there is none."""
    graph = onnx.load(str(path), load_external_data=False).graph
    constants = {t.name for t in graph.initializer}
    # A weight's DequantizeLinear reads it stored in INT8, or through a QuantizeLinear of the float weight (the
    # form ModelOpt writes): keyed by the weight's initializer.
    quantized_weight = {n.output[0]: n.input[0] for n in graph.node
                        if n.op_type == "QuantizeLinear" and n.input and n.input[0] in constants}
    dq_of_weight = {n.output[0]: quantized_weight.get(n.input[0], n.input[0]) for n in graph.node
                    if n.op_type == "DequantizeLinear" and n.input
                    and (n.input[0] in constants or n.input[0] in quantized_weight)}
    # Through the layout ops a weight may pass on its way to its reader (a Transpose of a tied embedding).
    changed = True
    while changed:
        changed = False
        for node in graph.node:
            if (node.op_type in _LAYOUT_OPS and node.input and node.input[0] in dq_of_weight
                    and node.output[0] not in dq_of_weight):
                dq_of_weight[node.output[0]] = dq_of_weight[node.input[0]]
                changed = True
    dq_outputs = {n.output[0] for n in graph.node if n.op_type == "DequantizeLinear"}
    skip = {"QuantizeLinear", "DequantizeLinear", *_LAYOUT_OPS}
    readers: Counter[str] = Counter()
    for node in graph.node:
        if node.op_type in skip:
            continue
        for name in {dq_of_weight[i] for i in node.input if i in dq_of_weight}:
            readers[name] += 1
    excluded_set = set(excluded)
    for node in graph.node:
        weights = {dq_of_weight[i] for i in node.input if i in dq_of_weight}
        shared = [w for w in weights if readers[w] > 1]
        if not shared or node.op_type in skip:
            continue
        float_inputs = [i for i in node.input if i and i not in constants and i not in dq_of_weight]
        if node.name in excluded_set or any(i not in dq_outputs for i in float_inputs):
            return f"node {node.name!r} reads the shared quantized weight {shared[0]!r} but is not quantized"
    return None


class PlacementUnknown(Exception):
    """ModelOpt failed on a placement run (the tool's reason is the message)."""


def modelopt_placement(fp32_path: Path, calibration: Mapping[str, NDArray[Any]], spec: CalibrationSpec) -> list[str]:
    """The nodes ModelOpt's recipe quantizes with `spec`'s node choices. Which nodes it quantizes depends on which
    are excluded (an Add or Mul fused with an excluded Conv is left in FP32 too), not on the ranges: so it is
    read from a run on the first sample with max calibration, a fraction of an entropy calibration's time."""
    first = {name: array[:1] for name, array in calibration.items()}
    with tempfile.TemporaryDirectory(prefix="trtbuild-placement-") as tmp, _quiet() as sink:
        out = Path(tmp) / "placement.onnx"
        try:
            with contextlib.chdir(tmp):
                _quantize_modelopt(fp32_path.resolve(), first, replace(spec, method=CalibrationMethod.MAX), out)
        except Exception as exc:
            if not _is_tool_failure(exc):
                raise
            raise PlacementUnknown(tool_cause(exc, sink.getvalue())) from exc
        return qdq_mix.quantized_nodes(onnx.load(str(out), load_external_data=False))


def entropy_order(fp32_path: Path, calibration: Mapping[str, NDArray[Any]], *,
                  whole: bool) -> Mapping[str, NDArray[Any]]:
    """The samples ordered for ModelOpt's entropy calibration (steps/calibration_order.py: its histograms take
    their bin width from the first batch, and its search costs the square of the bins). ModelOpt gives a
    batching model's samples one per batch (its dynamic batch dim taken as 1), as here. Where the FP32 graph
    does not run so, the data's order is kept: the calibration decides what to report."""
    try:
        order = calibration_order.entropy_order(fp32_path, list(sample_feeds(calibration, None if whole else 1)))
    except ORT_ERRORS as exc:
        log.debug("INT8: calibration samples kept in the data's order (ranges not read: %s)", tool_cause(exc))
        return calibration
    return {name: array[order] for name, array in calibration.items()}


def _whole_samples(fp32_path: Path, calibration: Mapping[str, NDArray[Any]]) -> bool:
    """True when the arrays hold one whole input per leading index (a model built with max_batch_size 0):
    each array then has one more dim than its input."""
    model = onnx.load(str(fp32_path), load_external_data=False)
    ranks = {i.name: len(i.type.tensor_type.shape.dim) for i in model.graph.input}
    return any(name in ranks and array.ndim == ranks[name] + 1 for name, array in calibration.items())


class _WholeSamples:
    """A calibration data reader (ONNX Runtime's get_next/rewind, ModelOpt's get_first) over whole samples."""

    def __init__(self, calibration: Mapping[str, NDArray[Any]]) -> None:
        self.feeds = list(sample_feeds(calibration, None))
        self.index = 0

    def get_next(self) -> dict[str, NDArray[Any]] | None:
        if self.index >= len(self.feeds):
            return None
        self.index += 1
        return self.feeds[self.index - 1]

    def get_first(self) -> dict[str, NDArray[Any]]:
        return self.feeds[0]

    def rewind(self) -> None:
        self.index = 0

    def set_range(self, start_index: int, end_index: int) -> None:
        self.feeds = self.feeds[start_index:end_index]
        self.index = 0


def _quantize_ort(fp32_path: Path, calibration: Mapping[str, NDArray[Any]], spec: CalibrationSpec,
                  tmp: Path, out: Path, runtime: str) -> str | None:
    """Run ONNX Runtime's quantizer in a fresh interpreter: importing ModelOpt patches ORT's
    quantization classes in place (modelopt/onnx/quantization/ort_patching.py), after which
    quantize_static fails or changes behaviour in the same process. A subprocess (rather than a
    multiprocessing spawn) also works from scripts that lack an `if __name__ == "__main__"` guard.
    Returns what the subprocess noted of a calibration that succeeded, if anything."""
    notes = tmp / _NOTES
    notes.unlink(missing_ok=True)
    samples = tmp / "calibration.npz"
    np.savez(samples, **calibration)
    job = tmp / "job.json"
    job.write_text(json.dumps({"fp32": str(fp32_path), "samples": str(samples), "tmp": str(tmp), "out": str(out),
                               "method": spec.method.value, "op_types_to_quantize": list(spec.op_types_to_quantize),
                               "dynamic": spec.recipe is Int8Recipe.ONNXRUNTIME_DYNAMIC,
                               "form": asdict(ort_form(runtime)),
                               "nodes_to_exclude": list(spec.nodes_to_exclude),
                               "nodes_to_quantize": list(spec.nodes_to_quantize),
                               "external": onnx_files.has_external_data(fp32_path),
                               "whole": _whole_samples(fp32_path, calibration)}))
    resources.release_free_memory()  # the subprocess runs beside this process: only what is in use stays
    try:
        proc = subprocess.run([sys.executable, "-m", "builder.steps.precision", str(job)], capture_output=True,
                              text=True, timeout=QUANTIZER_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        # TimeoutExpired carries bytes even with text=True.
        output = "\n".join(part.decode("utf-8", "replace") if isinstance(part, bytes) else part
                           for part in (exc.stdout, exc.stderr) if part)
        raise QuantizerFailed(f"the ONNX Runtime quantizer did not finish within {QUANTIZER_TIMEOUT_S:g} s "
                              "(TRTBUILD_QUANTIZER_TIMEOUT_S)", output) from exc
    if proc.returncode == _TOOL_FAILED:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        raise QuantizerFailed(lines[-1] if lines else "the ONNX Runtime quantizer failed", proc.stdout + proc.stderr)
    if proc.returncode != 0:  # anything else is a bug (ours or the tool's): keep the child's traceback
        raise QuantizerCrashed(f"the quantizer subprocess exited with status {proc.returncode}:\n{proc.stderr}")
    return notes.read_text().strip() if notes.is_file() else None


# The quantizer subprocess exits with this status when the tool itself refused the model (TOOL_ERRORS).
_TOOL_FAILED = 3
# What the quantizer subprocess has to say of a calibration that succeeded, for the parent to log (in its tmp).
_NOTES = "calibration_notes.txt"


class QuantizerCrashed(Exception):
    """The quantizer subprocess died of something other than a tool error: a bug, with its traceback."""


class QuantizerFailed(Exception):
    """The quantizer subprocess failed; `output` is everything it printed."""

    def __init__(self, message: str, output: str) -> None:
        super().__init__(message)
        self.output = output


# Per-channel Q/DQ needs DequantizeLinear's `axis`, which opset 13 added: ONNX Runtime's quantizer writes it into
# an older graph as it is (PP-OCR's opset 11/12 models), and the result fails the ONNX checker.
_PER_CHANNEL_OPSET = 13


def _rewrite_for_ort(prepared: Path, *, dynamic: bool) -> None:
    """int8_recipe's rewrites of the pre-processed graph, in place: an opset below 13 converted to 13 (onnx's
    version converter; where it cannot, the recipe fails as a tool and the next recipe is tried), Gemm biases made
    1-D (its optimizer writes MatMul + Add as a Gemm with a [1, N] bias), and for dynamic quantization Gemms made
    MatMuls."""
    model = onnx.load(str(prepared))
    changed = 0
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is not None and opset < _PER_CHANNEL_OPSET:
        model = version_converter.convert_version(model, _PER_CHANNEL_OPSET)
        changed += 1
    changed += int8_recipe.flatten_gemm_bias(model) + (int8_recipe.gemm_as_matmul(model) if dynamic else 0)
    if changed:
        onnx_files.save(model, prepared)


def _ort_quantize_worker(job_path: str) -> None:
    """Per-channel Q/DQ, U8S8 (the form ONNX Runtime's CPU kernels fuse: QLinearConv, QLinearMatMul) or symmetric
    S8S8 (TensorRT's) by the job's form; or dynamic quantization (MatMulInteger, per-channel int8 weights)."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )
    from onnxruntime.quantization import (
        CalibrationMethod as OrtCalibrationMethod,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    job = json.loads(Path(job_path).read_text())
    with np.load(job["samples"]) as archive:
        calibration = {k: archive[k] for k in archive.files}
    dynamic = bool(job.get("dynamic"))
    prepared = Path(job["tmp"]) / _ORT_PREPARED
    # A model with its weights beside it (over 2 GB) stays so: ORT's pre-processing otherwise reads the
    # data file from its own temporary folder, where it is not, and writes a message protobuf cannot hold.
    # Dynamic quantization: shape inference only, so that the nodes a guard excludes keep their names.
    external = bool(job.get("external"))
    quant_pre_process(job["fp32"], str(prepared), skip_optimization=dynamic, skip_symbolic_shape=True,
                      save_as_external_data=external, all_tensors_to_one_file=True,
                      external_data_location=onnx_files.data_file(prepared).name if external else None)
    _rewrite_for_ort(prepared, dynamic=dynamic)
    external = onnx_files.has_external_data(prepared)
    op_types = list(dict.fromkeys("MatMul" if op == "Gemm" and dynamic else op for op in job["op_types_to_quantize"]))
    if dynamic:
        quantize_dynamic(str(prepared), job["out"], op_types_to_quantize=op_types or None, per_channel=True,
                         weight_type=QuantType.QInt8, nodes_to_exclude=job["nodes_to_exclude"] or None,
                         nodes_to_quantize=job["nodes_to_quantize"] or None, use_external_data_format=external)
        return
    form = job["form"]
    count = len(next(iter(calibration.values())))
    whole = bool(job.get("whole"))  # one whole input per leading index (a model that does not batch)

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        """One sample per call, like a serving request at batch 1 (or as a whole input)."""

        def __init__(self) -> None:
            self.index = 0

        def get_next(self) -> dict[str, NDArray[Any]] | None:
            if self.index >= count:
                return None
            self.index += 1
            i = self.index - 1
            # A whole sample of a scalar input (a VAD's `sr`) stays a 0-d array: ORT refuses a numpy scalar.
            return {k: np.require(np.asarray(v[i]), requirements="C") if whole else v[i : i + 1]
                    for k, v in calibration.items()}

    entropy = job["method"] == CalibrationMethod.ENTROPY.value
    ranges = Path(job["tmp"]) / "entropy_ranges.json"
    with contextlib.redirect_stdout(io.StringIO()):  # ORT's calibrator prints its progress
        if entropy:  # streamed, in bounded memory; quantize_static then reads the ranges as its cache
            work = Path(job["tmp"]) / "entropy"
            work.mkdir(exist_ok=True)
            beyond: dict[str, tuple[int, int]] = {}
            tensors = ort_calibration.entropy_ranges(prepared, lambda: iter(Reader()), op_types=op_types,
                                                     external=external, workdir=work, beyond=beyond)
            ort_calibration.save_ranges(tensors, ranges)
            if beyond:  # said by the parent (this process's stdout is ORT's progress; its stderr unread on success)
                worst = sorted(beyond.items(), key=lambda item: -item[1][0] / max(item[1][1], 1))[:3]
                Path(job["tmp"], _NOTES).write_text(
                    f"{len(beyond)} calibrated tensor{'s' if len(beyond) != 1 else ''} had values beyond the first "
                    "calibration pass's range in the second (the graph's runs differ: random ops, or kernels that "
                    "are not repeatable); counted in the histograms' edge bins: "
                    + ", ".join(f"{name} {out / max(total, 1):.1%} of {total}" for name, (out, total) in worst))
        quantize_static(
            str(prepared),
            job["out"],
            Reader(),
            calibration_cache_path=ranges if entropy else None,
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType[form["activations"]],
            weight_type=QuantType[form["weights"]],
            calibrate_method=OrtCalibrationMethod.Entropy if entropy else OrtCalibrationMethod.MinMax,
            op_types_to_quantize=op_types or None,
            nodes_to_exclude=job["nodes_to_exclude"] or None,
            nodes_to_quantize=job["nodes_to_quantize"] or None,
            use_external_data_format=external,
            extra_options={"ActivationSymmetric": form["symmetric_activations"], "WeightSymmetric": True},
        )


if __name__ == "__main__":
    try:
        _ort_quantize_worker(sys.argv[1])
    except (*TOOL_ERRORS, KeyError, IndexError) as exc:  # type: ignore[misc]  # ORT's quantizer also fails so on graphs it misreads
        # A calibration the samples cannot give (ort_calibration.CalibrationFailed) fails as ONNX Runtime's own
        # calibrator would on them: the tool's failure, not a bug of ours.
        if not (isinstance(exc, ort_calibration.CalibrationFailed) or raised_by_tool(exc)):
            raise  # a bug of ours: exit 1 with the traceback (QuantizerCrashed)
        traceback.print_exc()
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(_TOOL_FAILED)
