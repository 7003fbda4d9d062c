"""Precision variants of an FP32 ONNX model: FP16 (ModelOpt autocast) and INT8 (ModelOpt PTQ, Q/DQ).

The Q/DQ ONNX is the portable artifact: TensorRT builds it strongly typed on a GPU, ONNX Runtime
runs it on a CPU. Calibration is the slow part, so its result is cached by everything it depends on.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from numpy.typing import NDArray

from builder.errors import BuilderError, last_line
from builder.runtimes.onnxruntime import ORT_ERRORS
from builder.spec.enums import CalibrationMethod, Int8Recipe
from builder.spec.model import CalibrationSpec
from builder.spec.settings import default_cache_dir
from builder.steps import onnx_model
from client.files import copy_atomic

log = logging.getLogger(__name__)

# Bump when the way a variant is produced changes, so caches and repositories rebuild.
RECIPE_VERSION = "1"


@dataclass(frozen=True)
class CalibrationResult:
    recipe: Int8Recipe
    method: CalibrationMethod
    samples: int
    cache_key: str
    cached: bool  # reused from the calibration cache
    quantize_linear_nodes: int
    settings: dict[str, object]  # the tool and the options it ran with, as recorded in build.json


# Failures of the tools a variant is made with that mean "this model or these settings do not work
# with it": they become one line naming a log file with the tool's full output. Any other exception
# is a bug (ours or the tool's) and keeps its traceback.
TOOL_ERRORS: tuple[type[BaseException], ...] = (
    RuntimeError, ValueError, AssertionError, OSError, onnx.checker.ValidationError,
    onnx.shape_inference.InferenceError, *ORT_ERRORS,
)
# The ONNX Runtime quantizer runs in a subprocess; a calibration that takes longer is stuck.
QUANTIZER_TIMEOUT_S = float(os.environ.get("TRTBUILD_QUANTIZER_TIMEOUT_S", "3600"))


def failure_log(what: str, output: str, exc: BaseException | None) -> Path | str:
    """Write a tool's captured output (and the exception's traceback) where the one-line error names it;
    where no log can be written, say why instead (the tool's failure is the error to report)."""
    folder = default_cache_dir() / "logs"
    path = folder / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', what)}.log"
    trace = "".join(traceback.format_exception(exc)) if exc is not None else ""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{what}\n\n--- tool output ---\n{output}\n--- exception ---\n{trace}", encoding="utf-8")
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


def to_fp16(fp32_path: Path, out_path: Path) -> dict[str, object]:
    """FP16 compute with FP32 inputs and outputs, so clients and configs stay unchanged."""
    settings: dict[str, object] = {"tool": "modelopt.onnx.autocast", "keep_io_types": True, "data_max": 512}
    with _quiet() as sink:
        from modelopt.onnx.autocast import convert_to_mixed_precision

        try:
            model = convert_to_mixed_precision(str(fp32_path), low_precision_type="fp16", keep_io_types=True)
        except TOOL_ERRORS as exc:
            record = failure_log(f"fp16 {fp32_path.name}", sink.getvalue(), exc)
            raise BuilderError(f"{fp32_path}: FP16 conversion failed: {last_line(exc)} (full output: {record})"
                               ) from exc
    onnx.save(model, str(out_path))
    onnx_model.load(out_path)
    return settings


def calibration_key(fp32_sha: str, data_digest: str, spec: CalibrationSpec) -> str:
    payload = {
        "onnx": fp32_sha,
        "data": data_digest,
        "method": spec.method,
        "recipe": spec.recipe,
        "op_types_to_quantize": list(spec.op_types_to_quantize),
        "nodes_to_exclude": list(spec.nodes_to_exclude),
        "nodes_to_quantize": list(spec.nodes_to_quantize),
        "modelopt": version("nvidia-modelopt"),
        "onnxruntime": version("onnxruntime"),
        "recipe_version": RECIPE_VERSION,
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
) -> CalibrationResult:
    """INT8 Q/DQ by post-training quantization (ModelOpt or ONNX Runtime); reuses a cached result."""
    key = calibration_key(fp32_sha, data_digest, spec)
    samples = len(next(iter(calibration.values())))
    settings: dict[str, object] = {
        "recipe": spec.recipe,
        "method": spec.method,
        "samples": samples,
        "op_types_to_quantize": list(spec.op_types_to_quantize) or "default",
        "nodes_to_exclude": list(spec.nodes_to_exclude),
    }
    if spec.recipe is Int8Recipe.MODELOPT:
        settings.update(tool="modelopt.onnx.quantization", high_precision_dtype="fp32", calibration_eps=["cpu"])
    else:
        settings.update(tool="onnxruntime.quantization.quantize_static", format="QDQ", per_channel=True,
                        activations="uint8 (asymmetric)", weights="int8 (symmetric)")
    cached = cache_dir / "calibration" / f"{key}.onnx"
    if cached.is_file():
        log.info("INT8: reusing calibration %s (inputs unchanged)", key[:12])
        shutil.copyfile(cached, out_path)
        return CalibrationResult(spec.recipe, spec.method, samples, key, True, _count_q(out_path), settings)
    log.info("INT8: calibrating on %d samples (%s, %s recipe)", samples, spec.method, spec.recipe)
    with tempfile.TemporaryDirectory(prefix="trtbuild-int8-") as tmp, _quiet() as sink:
        tmp_out = Path(tmp) / "int8.onnx"
        try:
            if spec.recipe is Int8Recipe.ONNXRUNTIME:
                _quantize_ort(fp32_path, calibration, spec, Path(tmp), tmp_out)
            else:
                _quantize_modelopt(fp32_path, calibration, spec, tmp_out)
        except _INT8_ERRORS as exc:
            output = sink.getvalue() + (exc.output if isinstance(exc, QuantizerFailed) else "")
            record = failure_log(f"int8 {spec.recipe} {fp32_path.name}", output, exc)
            raise BuilderError(f"{fp32_path}: INT8 calibration ({spec.recipe}) failed: {last_line(exc)} "
                               f"(full output: {record})") from exc
        quantized = onnx_model.load(tmp_out)
        qdq = sum(1 for n in quantized.graph.node if n.op_type == "QuantizeLinear")
        if qdq == 0 and not spec.nodes_to_quantize:
            log.warning("INT8: %s quantized no node of %s (ModelOpt skips GEMV-shaped and small MatMuls); "
                        "the int8 variant computes in FP32", spec.recipe, fp32_path.name)
        copy_atomic(tmp_out, cached)
        shutil.copyfile(tmp_out, out_path)
    return CalibrationResult(spec.recipe, spec.method, samples, key, False, qdq, settings)


def _count_q(path: Path) -> int:
    return sum(1 for n in onnx.load(str(path)).graph.node if n.op_type == "QuantizeLinear")


def _quantize_modelopt(fp32_path: Path, calibration: Mapping[str, NDArray[Any]], spec: CalibrationSpec,
                       out: Path) -> None:
    from modelopt.onnx.quantization import quantize

    quantize(
        str(fp32_path),
        quantize_mode="int8",
        calibration_data=dict(calibration),
        calibration_method=spec.method,
        calibration_eps=["cpu"],
        # FP32 between Q/DQ pairs: the FP16 default loses accuracy badly under ONNX Runtime
        # on CPU (measured: 6 % top-1 agreement vs 88 %), and TensorRT fuses either.
        high_precision_dtype="fp32",
        op_types_to_quantize=list(spec.op_types_to_quantize) or None,
        nodes_to_exclude=list(spec.nodes_to_exclude) or None,
        nodes_to_quantize=list(spec.nodes_to_quantize) or None,
        output_path=str(out),
        log_level="WARNING",
    )


def _quantize_ort(fp32_path: Path, calibration: Mapping[str, NDArray[Any]], spec: CalibrationSpec,
                  tmp: Path, out: Path) -> None:
    """Run ONNX Runtime's quantizer in a fresh interpreter: importing ModelOpt patches ORT's
    quantization classes in place (modelopt/onnx/quantization/ort_patching.py), after which
    quantize_static fails or changes behaviour in the same process. A subprocess (rather than a
    multiprocessing spawn) also works from scripts that lack an `if __name__ == "__main__"` guard."""
    samples = tmp / "calibration.npz"
    np.savez(samples, **calibration)
    job = tmp / "job.json"
    job.write_text(json.dumps({"fp32": str(fp32_path), "samples": str(samples), "tmp": str(tmp), "out": str(out),
                               "method": spec.method.value, "op_types_to_quantize": list(spec.op_types_to_quantize),
                               "nodes_to_exclude": list(spec.nodes_to_exclude),
                               "nodes_to_quantize": list(spec.nodes_to_quantize)}))
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


# The quantizer subprocess exits with this status when the tool itself refused the model (TOOL_ERRORS).
_TOOL_FAILED = 3


class QuantizerCrashed(Exception):
    """The quantizer subprocess died of something other than a tool error: a bug, with its traceback."""


class QuantizerFailed(Exception):
    """The quantizer subprocess failed; `output` is everything it printed."""

    def __init__(self, message: str, output: str) -> None:
        super().__init__(message)
        self.output = output


_INT8_ERRORS: tuple[type[BaseException], ...] = (*TOOL_ERRORS, QuantizerFailed)


def _ort_quantize_worker(job_path: str) -> None:
    """Per-channel U8S8 Q/DQ: the form ONNX Runtime's CPU kernels fuse (QLinearConv, MatMulInteger)."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization import (
        CalibrationMethod as OrtCalibrationMethod,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    job = json.loads(Path(job_path).read_text())
    with np.load(job["samples"]) as archive:
        calibration = {k: archive[k] for k in archive.files}
    prepared = str(Path(job["tmp"]) / "prepared.onnx")
    quant_pre_process(job["fp32"], prepared, skip_symbolic_shape=True)
    count = len(next(iter(calibration.values())))

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        """One sample per call, like a serving request at batch 1."""

        def __init__(self) -> None:
            self.index = 0

        def get_next(self) -> dict[str, NDArray[Any]] | None:
            if self.index >= count:
                return None
            self.index += 1
            return {k: v[self.index - 1 : self.index] for k, v in calibration.items()}

    with contextlib.redirect_stdout(io.StringIO()):  # ORT's calibrator prints its progress
        quantize_static(
            prepared,
            job["out"],
            Reader(),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=(OrtCalibrationMethod.Entropy if job["method"] == CalibrationMethod.ENTROPY.value
                             else OrtCalibrationMethod.MinMax),
            op_types_to_quantize=job["op_types_to_quantize"] or None,
            nodes_to_exclude=job["nodes_to_exclude"] or None,
            nodes_to_quantize=job["nodes_to_quantize"] or None,
        )


if __name__ == "__main__":
    try:
        _ort_quantize_worker(sys.argv[1])
    except TOOL_ERRORS as exc:
        traceback.print_exc()
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(_TOOL_FAILED)
