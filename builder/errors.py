"""One exception base for the package; the CLI prints these as one line and exits 1."""

import re

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def last_line(exc: BaseException, limit: int = 300) -> str:
    """A third-party error's last non-empty line (where tools put the reason), without ONNX Runtime's
    ANSI colour codes, for a one-line message."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return _ANSI.sub("", lines[-1] if lines else type(exc).__name__)[:limit]


class BuilderError(Exception):
    """A user-facing error: bad input, a failed check, a missing tool."""


class ManifestError(BuilderError):
    """models.toml or a command-line option is invalid."""


class OnnxModelError(BuilderError):
    """An ONNX file is missing, unreadable or not a valid model."""


class DataError(BuilderError):
    """Calibration or evaluation data does not match the model's inputs."""


class AccuracyError(BuilderError):
    """A variant is outside its accuracy tolerance."""


class ServerError(BuilderError):
    """The Triton server could not be started, reached or stopped."""


class RuntimeUnavailableError(BuilderError):
    """A requested runtime (TensorRT) is not installed or has no GPU."""
