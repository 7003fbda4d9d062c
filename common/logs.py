"""Logging for the command-line tools (both CLIs use it; library modules only log).

The terminal shows our own packages' lines: INFO by default, DEBUG with -v, WARNING with -q.
Third-party libraries (ModelOpt, ONNX Runtime, onnxscript, transformers, urllib3, ...) go to the log
file when there is one (trtbuild's build log) and reach the terminal only with -v (warnings) or -vv
(everything). Without a log file (perfclient) their warnings still reach the terminal, else they
would be lost. Python warnings are logged (logger `py.warnings`), so they follow the same rule.

`native_stderr_to_log()` also sends what C/C++ libraries write straight to file descriptor 2 (ONNX
Runtime's coloured log lines, TensorRT's logger) into the log file, while Python's `sys.stderr`, and
with it our messages, progress and tracebacks, stays on the terminal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from common import progress

_FORMAT = "%(levelname)s %(name)s: %(message)s"
_FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_active_log: Path | None = None


def active_log_file() -> Path | None:
    """The log file the running CLI writes library output to; None when there is none. For the CLI that
    configured it: library code is given the log file as an argument (trtbuild: BuildOptions.log_file and
    runtimes.select(log_file=...)), never reads it here."""
    return _active_log


def default_log_file(kind: str = "build") -> Path:
    """`.logs/build-<UTC timestamp>-<pid>.log` (the folder: $TRTBUILD_LOG_DIR if set): one file per run."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return Path(os.environ.get("TRTBUILD_LOG_DIR") or ".logs") / f"{kind}-{stamp}-{os.getpid()}.log"


class _Ours(logging.Filter):
    """What the terminal shows: our packages' records at their level; others' only where allowed."""

    def __init__(self, packages: Sequence[str], ours: int, others: int) -> None:
        super().__init__()
        self.prefixes = tuple(packages)
        self.ours = ours
        self.others = others

    def filter(self, record: logging.LogRecord) -> bool:
        mine = any(record.name == p or record.name.startswith(p + ".") for p in self.prefixes)
        return record.levelno >= (self.ours if mine else self.others)


class _TerminalHandler(logging.Handler):
    """Writes through the progress display, so a line never tears a live progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            progress.echo(self.format(record))
        except Exception:  # noqa: BLE001 - logging's own contract: a failed emit is reported, not raised
            self.handleError(record)


class _FileHandler(logging.FileHandler):
    pass


def configure_logging(packages: Sequence[str], *, verbose: int, quiet: bool, log_file: Path | None = None) -> None:
    """Set up the terminal handler and, with `log_file`, a file that receives every library's lines
    (and our DEBUG lines). Calling it again replaces what an earlier call installed.

    Raises OSError when the log file cannot be created; the caller names the flag.
    """
    global _active_log
    root = logging.getLogger()
    for handler in root.handlers[:]:
        if isinstance(handler, (_TerminalHandler, _FileHandler)):
            root.removeHandler(handler)
            handler.close()
    _active_log = None

    ours = logging.WARNING if quiet else logging.DEBUG if verbose >= 1 else logging.INFO
    if verbose >= 2 and not quiet:
        others = logging.DEBUG
    elif (verbose >= 1 and not quiet) or log_file is None:
        others = logging.WARNING
    else:
        others = logging.CRITICAL + 1  # into the log file only
    terminal = _TerminalHandler()
    terminal.setFormatter(logging.Formatter(_FORMAT))
    terminal.addFilter(_Ours(packages, ours, others))
    root.addHandler(terminal)

    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handler = _FileHandler(log_file, encoding="utf-8")
        handler.setFormatter(logging.Formatter(_FILE_FORMAT))
        handler.setLevel(logging.DEBUG)
        root.addHandler(handler)
        _active_log = log_file

    # Loggers pass records to the handlers, which decide where each goes; without a log file the
    # libraries' INFO lines would go nowhere, so they are not even formatted.
    if verbose >= 2 and not quiet:
        root.setLevel(logging.DEBUG)
    else:
        root.setLevel(logging.INFO if log_file is not None else logging.WARNING)
    for name in packages:
        logging.getLogger(name).setLevel(logging.DEBUG if log_file is not None or verbose >= 1 else ours)
    # Off, then on: captureWarnings(True) does nothing when an earlier call is still on record, even where
    # something (a `warnings.catch_warnings` block, a test harness) has replaced the hook since.
    logging.captureWarnings(False)
    logging.captureWarnings(True)


def close_log_file() -> None:
    """Detach and close the log file (the CLI's run is over); the terminal handler stays."""
    global _active_log
    root = logging.getLogger()
    for handler in root.handlers[:]:
        if isinstance(handler, _FileHandler):
            root.removeHandler(handler)
            handler.close()
    _active_log = None


@contextlib.contextmanager
def native_stderr_to_log() -> Iterator[None]:
    """While active, file descriptor 2 writes to the active log file and `sys.stderr` to the terminal
    (a duplicate of the old descriptor 2). Configure progress after entering, so it writes to the
    terminal. Does nothing without a log file."""
    path = _active_log
    if path is None:
        yield
        return
    sys.stderr.flush()
    try:
        on_fd2 = sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):  # an in-memory stream (a test's capture): leave it be
        on_fd2 = False
    terminal_fd = os.dup(2)
    log_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    saved_stderr = sys.stderr
    terminal = os.fdopen(terminal_fd, "w", buffering=1, encoding="utf-8", errors="replace")
    try:
        os.dup2(log_fd, 2)
    finally:
        os.close(log_fd)
    if on_fd2:
        sys.stderr = terminal
    try:
        yield
    finally:
        terminal.flush()
        os.dup2(terminal.fileno(), 2)  # descriptor 2 is the terminal again
        sys.stderr = saved_stderr
        terminal.close()
