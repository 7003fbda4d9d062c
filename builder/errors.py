"""One exception base for the package; the CLI prints these as one line and exits 1."""

from __future__ import annotations

import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from builder.steps.accuracy import Violation

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# ONNX Runtime's reason inside a longer message: "[ONNXRuntimeError] : 2 : X : <reason>", and within
# the reason "... running Concat node. Name:'n' Status Message: concatbase.h:133 Fn <what is wrong>".
_ORT_REASON = re.compile(r"\[ONNXRuntimeError\] : \d+ : \w+ : (.*)")
_ORT_NODE = re.compile(r"running (\w+) node\. Name:'([^']*)' Status Message: (?:\S+:\d+ \w+ )?(.*)")


def last_line(exc: BaseException, limit: int = 300) -> str:
    """A third-party error's last non-empty line (where tools put the reason), without ONNX Runtime's
    ANSI colour codes, for a one-line message."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return _ANSI.sub("", lines[-1] if lines else type(exc).__name__)[:limit]


def tool_cause(exc: BaseException, output: str = "", *, hide: Mapping[Path, str] | None = None,
               limit: int = 300) -> str:
    """The reason a library gave, for a one-line message: its last line, ONNX Runtime's own reason
    where one is embedded, no colour codes, and no temporary paths of ours (`hide` maps a path to the
    words that replace it; other paths under the temporary folder become their file name).

    A bare `Exception` (ModelOpt's "ONNXRuntime failed to run, see logs for details") carries no
    reason: then the tool's captured `output` is searched for ONNX Runtime's."""
    text = _ANSI.sub("", str(exc))
    if type(exc) is Exception and output:
        text = _ANSI.sub("", output)
    reasons = list(_ORT_REASON.finditer(text))
    if reasons:
        # ONNX Runtime continues some reasons on the next lines (" index: 1 Got: 2 Expected: 8"): keep
        # those, up to its closing advice or a line that is not indented.
        cause = reasons[-1].group(1).strip()
        for extra in text[reasons[-1].end():].splitlines()[1:]:
            if not extra.startswith((" ", "\t")) or not extra.strip() or "Please fix" in extra:
                break
            cause += f"; {extra.strip()}"
    else:
        cause = last_line(exc, limit=10_000)
    node = _ORT_NODE.search(cause)
    if node is not None:
        cause = f"{node.group(1)} node {node.group(2)!r}: {node.group(3)}"
    for path, words in sorted((hide or {}).items(), key=lambda kv: -len(str(kv[0]))):
        cause = cause.replace(str(path), words)
    temp = re.escape(tempfile.gettempdir().rstrip("/"))
    cause = re.sub(temp + r"/[^\s'\"]*", lambda m: Path(m.group(0)).name or "a temporary file", cause)
    return cause[:limit]


class BuilderError(Exception):
    """A user-facing error: bad input, a failed check, a missing tool."""


class ManifestError(BuilderError):
    """models.toml or a command-line option is invalid."""


class OnnxModelError(BuilderError):
    """An ONNX file is missing, unreadable or not a valid model."""


class DataError(BuilderError):
    """Calibration or evaluation data does not match the model's inputs."""


class AccuracyError(BuilderError):
    """A variant is outside its accuracy tolerance; `violation` (steps.accuracy.Violation) says which
    metric, its value and the limit, where known."""

    def __init__(self, message: str, *, violation: Violation | None = None, guard: str | None = None) -> None:
        super().__init__(message)
        self.violation = violation
        self.guard = guard  # whether a guard ran, for the failure line ("after the INT8 guard", "--no-guard")


class ToolError(BuilderError):
    """A library (ModelOpt, ONNX Runtime, onnx) refused this model or these settings; the message is one
    line naming the model, the step, the cause and the log file holding the tool's full output."""


class VariantsFailed(BuilderError):
    """Some variants failed while the others were written; the message lists each failure, one a line."""


class ServerError(BuilderError):
    """The Triton server could not be started, reached or stopped."""


class RuntimeUnavailableError(BuilderError):
    """A requested runtime (TensorRT) is not installed or has no GPU."""
