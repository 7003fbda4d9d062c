"""Progress of long work, for library code that knows nothing about terminals.

    from common import progress
    with progress.task("calibrating efficientnet_lite0_int8") as t:       # unknown length: a spinner
        ...
    with progress.task("guard sensitivity", total=len(nodes)) as t:
        for node in nodes:
            ...
            t.advance(status=node)

A CLI picks the rendering once (`configure`): a live rich progress display (bar, counts, elapsed and
remaining time) on a terminal, plain rate-limited lines when the output is not a terminal (CI logs),
or nothing (`-q`). Until a CLI configures it, nothing is shown: library use and tests stay silent.

rich is the library: maintained, it tells terminals from pipes, and its progress display and tables
share one console, so log lines printed while a bar is live land above the bar instead of through it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Protocol, TextIO

from rich.console import Console, ConsoleDimensions
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Column

from common.choices import Choice

__all__ = ["ENV", "Mode", "Task", "configure", "echo", "mode", "pick_mode", "task"]

log = logging.getLogger(__name__)


class Mode(Choice):
    OFF = "off"  # nothing (the default, and -q)
    PLAIN = "plain"  # one line per start, end and at most one per interval in between
    LIVE = "live"  # rich live display


class _Renderer(Protocol):
    def start(self, task: Task) -> None: ...
    def changed(self, task: Task) -> None: ...
    def finish(self, task: Task, failed: bool) -> None: ...
    def echo(self, line: str) -> None: ...
    def close(self) -> None: ...


class Task:
    """One piece of work being tracked; `total` None means its length is unknown."""

    def __init__(self, description: str, total: int | None, renderer: _Renderer, *, loop: bool = False) -> None:
        self.description = description
        self.total = total
        self.loop = loop or total is not None  # its steps are counted: tasks inside it are its steps' parts
        self.completed = 0
        self.status = ""
        self.started = time.monotonic()
        self._renderer = renderer
        self._id: TaskID | None = None  # the rich task, where the live renderer shows it
        self._last_line = 0.0  # when the plain renderer last printed this task

    def advance(self, steps: int = 1, *, status: str | None = None) -> None:
        self.completed += steps
        if status is not None:
            self.status = status
        self._renderer.changed(self)

    def update(self, status: str | None = None, *, total: int | None = None) -> None:
        """A new status text (what it is doing now) and/or a total learnt late."""
        if status is not None:
            self.status = status
        if total is not None:
            self.total = total
        self._renderer.changed(self)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def remaining(self) -> float | None:
        """Seconds left at the rate so far; None while unknown (no total, or nothing done yet)."""
        if self.total is None or self.completed <= 0:
            return None
        return max(0.0, self.elapsed / self.completed * (self.total - self.completed))


class _Silent:
    def start(self, task: Task) -> None:
        pass

    def changed(self, task: Task) -> None:
        pass

    def finish(self, task: Task, failed: bool) -> None:
        pass

    def echo(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def _duration(value: float) -> str:
    seconds = round(value)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


class _Plain:
    """Lines for logs: the start, the end, and in between a line when at least `interval` seconds passed
    and either a tenth of the total more is done or `quiet_limit` seconds passed (a 40-minute search
    then writes about 20 lines, not 240). A step that reports nothing while it runs (a calibration, a
    TensorRT build) gets a line every `quiet_limit` seconds too, from a timer: a CI log shows it is still
    going (and a CI that kills silent jobs does not kill it).
    Tasks opened inside a counted task (a loop with a total, or one opened with `loop=True`) print
    nothing: the loop's own lines say how far it is, and a line per iteration would flood the log."""

    def __init__(self, stream: TextIO | None, interval: float, quiet_limit: float = 120.0) -> None:
        self.stream = stream  # None: whatever sys.stderr is at the time of each line
        self.interval = interval
        self.quiet_limit = max(interval, quiet_limit)
        self.reported: dict[int, int] = {}  # task id -> steps done at its last line
        self.lock = threading.Lock()  # around the stream and the lists below (the timer reads them)
        self.open: list[Task] = []
        self.hidden: set[int] = set()  # ids of tasks inside a counted task
        self.stop = threading.Event()
        self.timer: threading.Thread | None = None

    def _line(self, text: str) -> None:
        with self.lock:
            print(text, file=self.stream or sys.stderr, flush=True)

    def start(self, task: Task) -> None:
        with self.lock:
            inside_loop = any(t.loop for t in self.open)
            self.open.append(task)
            if inside_loop:
                self.hidden.add(id(task))
                return
            task._last_line = time.monotonic()
            if self.timer is None:
                self.timer = threading.Thread(target=self._tick, name="progress-plain", daemon=True)
                self.timer.start()
        total = f" ({task.total} steps)" if task.total is not None else ""
        self._line(f"[start] {task.description}{total}")

    def _tick(self) -> None:
        """Every so often: a line for the innermost shown task when it has been quiet for `quiet_limit`."""
        while not self.stop.wait(min(1.0, self.quiet_limit / 4)):
            with self.lock:
                shown = [t for t in self.open if id(t) not in self.hidden]
            if shown and time.monotonic() - shown[-1]._last_line >= self.quiet_limit:
                self._report(shown[-1])

    def changed(self, task: Task) -> None:
        if id(task) in self.hidden:
            return
        since = time.monotonic() - task._last_line
        done = task.completed - self.reported.get(id(task), 0)
        tenth = task.total is not None and task.total > 0 and done * 10 >= task.total
        if since < self.interval or not (tenth or since >= self.quiet_limit):
            return
        self._report(task)

    def _report(self, task: Task) -> None:
        task._last_line = time.monotonic()
        self.reported[id(task)] = task.completed
        parts = [task.description]
        if task.total is not None:
            percent = 100 * task.completed / task.total if task.total else 100.0
            parts.append(f"{task.completed}/{task.total} ({percent:.0f} %)")
        elif task.completed:
            parts.append(str(task.completed))
        parts.append(f"{_duration(task.elapsed)} elapsed")
        left = task.remaining()
        if left is not None:
            parts.append(f"~{_duration(left)} left")
        if task.status:
            parts.append(task.status)
        self._line("[....] " + ", ".join(parts))

    def finish(self, task: Task, failed: bool) -> None:
        with self.lock:
            if task in self.open:
                self.open.remove(task)
            self.reported.pop(id(task), None)
            if id(task) in self.hidden:
                self.hidden.discard(id(task))
                return
        count = f"{task.completed}/{task.total}, " if task.total is not None else ""
        self._line(f"[{'fail' if failed else 'done'}] {task.description} ({count}{_duration(task.elapsed)})")

    def echo(self, line: str) -> None:
        self._line(line)

    def close(self) -> None:
        self.stop.set()
        if self.timer is not None:
            self.timer.join(timeout=5)
            self.timer = None
        with self.lock:
            self.open.clear()
            self.hidden.clear()
            self.reported.clear()


_LIVE_MAX_WIDTH = 120  # a wider terminal gets a 120-column display, not bars spread over the whole width


class _TerminalConsole(Console):
    """A console as wide as the terminal it writes to. rich measures descriptors 0, 1 and 2, which during a
    build are the log file (descriptor 2, see common.logs) and maybe a pipe or /dev/null: it then assumes
    80 columns whatever the terminal's real width."""

    @property
    def size(self) -> ConsoleDimensions:
        measured = super().size
        width = measured.width
        try:
            if "COLUMNS" not in os.environ:  # rich's own rule: $COLUMNS wins
                width = os.get_terminal_size(self.file.fileno()).columns or width
        except (AttributeError, ValueError, OSError):  # not a terminal, or an in-memory stream
            pass
        return ConsoleDimensions(min(width, _LIVE_MAX_WIDTH), measured.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:  # as rich's own setter: a fixed size
        self._width, self._height = new_size


def _columns() -> tuple[ProgressColumn, ...]:
    """Counts, elapsed and remaining time keep their width; the description and the status give way (cut
    with an ellipsis) on a narrow terminal. Without these limits rich cut the counts and times first: at
    80 columns a guard's sensitivity pass read `0/… 0:… eta -:-…`."""
    def fixed(width: int) -> Column:
        return Column(no_wrap=True, min_width=width)

    return (
        SpinnerColumn(table_column=fixed(1)),
        TextColumn("{task.description}", table_column=Column(ratio=2, no_wrap=True, overflow="ellipsis",
                                                             min_width=12)),
        BarColumn(bar_width=12, table_column=fixed(12)),
        MofNCompleteColumn(table_column=fixed(3)),
        TimeElapsedColumn(table_column=fixed(7)),
        TextColumn("[dim]eta[/]", table_column=fixed(3)),
        TimeRemainingColumn(table_column=fixed(7)),
        TextColumn("{task.fields[status]}", style="dim",
                   table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis")),
    )


class _Live:
    """A rich progress display, started with the first open task and stopped with the last; finished
    tasks leave the screen (the CLI prints its own summary)."""

    def __init__(self, stream: TextIO | None) -> None:
        # Without a file, rich writes to whatever sys.stderr is at the time (see common.logs).
        self.console = _TerminalConsole(file=stream, stderr=stream is None)
        self.progress: Progress | None = None
        self.open = 0
        self.lock = threading.RLock()

    def _display(self) -> Progress:
        if self.progress is None:
            # expand: the columns share the width by their ratios, so the fixed ones are never cut.
            self.progress = Progress(
                *_columns(), console=self.console, transient=True, redirect_stdout=False, redirect_stderr=False,
                expand=True,
            )
            self.progress.start()
        return self.progress

    def start(self, task: Task) -> None:
        with self.lock:
            self.open += 1
            task._id = self._display().add_task(task.description, total=task.total, status=task.status)

    def changed(self, task: Task) -> None:
        with self.lock:
            if self.progress is not None and task._id is not None:
                self.progress.update(task._id, completed=task.completed, total=task.total, status=task.status)

    def finish(self, task: Task, failed: bool) -> None:
        with self.lock:
            if self.progress is not None and task._id is not None:
                self.progress.remove_task(task._id)
            self.open -= 1
            if self.open <= 0 and self.progress is not None:
                self.progress.stop()
                self.progress = None
                self.open = 0

    def echo(self, line: str) -> None:
        with self.lock:
            # Printed through the live console: above the bars, which are redrawn below it.
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def close(self) -> None:
        with self.lock:
            if self.progress is not None:
                self.progress.stop()
                self.progress = None
            self.open = 0


_renderer: _Renderer = _Silent()
_mode = Mode.OFF


ENV = "TRTSERVE_PROGRESS"  # live | plain | off: overrides the terminal check (a CI that fakes a TTY, tests)


def pick_mode(stream: TextIO, *, quiet: bool = False, enabled: bool = True) -> Mode:
    """What a CLI shows on `stream`: nothing with -q (or progress turned off), else what $TRTSERVE_PROGRESS
    says, else a live display on a terminal and plain lines otherwise."""
    if quiet or not enabled:
        return Mode.OFF
    chosen = os.environ.get(ENV, "").strip().lower()
    if chosen in Mode.values():
        return Mode(chosen)
    if chosen:
        log.warning("$%s=%r: expected one of %s; choosing by the terminal", ENV, chosen, ", ".join(Mode.values()))
    return Mode.LIVE if stream.isatty() else Mode.PLAIN


def configure(mode: Mode, *, stream: TextIO | None = None, interval: float = 10.0,
              quiet_limit: float = 120.0) -> None:
    """Choose the rendering for every later task (CLIs only). `stream` None: sys.stderr as it is when
    each line is written. `interval`: seconds at least between a plain task's progress lines;
    `quiet_limit`: seconds at most without a line while a plain task runs."""
    global _renderer, _mode
    _renderer.close()  # a live display still up (a task left open by an error) is taken down
    _mode = mode
    if mode is Mode.LIVE:
        _renderer = _Live(stream)
    elif mode is Mode.PLAIN:
        _renderer = _Plain(stream, interval, quiet_limit)
    else:
        _renderer = _Silent()


def mode() -> Mode:
    return _mode


def echo(line: str) -> None:
    """A line for the user's terminal (stderr) that does not tear a live display."""
    _renderer.echo(line)


@contextlib.contextmanager
def task(description: str, total: int | None = None, *, loop: bool = False) -> Iterator[Task]:
    """Track one piece of work; the rendering configured now shows it until the block ends. `loop`: a loop
    of unknown length whose steps advance() counts (a search); like one with a total, the tasks opened
    inside it are parts of its steps and print no plain lines of their own."""
    renderer = _renderer
    current = Task(description, total, renderer, loop=loop)
    renderer.start(current)
    failed = True
    try:
        yield current
        failed = False
    finally:
        renderer.finish(current, failed)
