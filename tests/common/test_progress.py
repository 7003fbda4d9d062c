"""common.progress: plain lines off a terminal, a live display on one, nothing with -q or by default."""

from __future__ import annotations

import fcntl
import io
import os
import re
import struct
import subprocess
import sys
import termios
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from common import progress
from tests.helpers.cli_state import cli_progress_restored  # noqa: F401 - autouse fixture
from tests.helpers.tiny_models import mlp_onnx
from tests.helpers.waiting import wait_until


def test_plain_lines_say_start_progress_and_end() -> None:
    stream = io.StringIO()
    progress.configure(progress.Mode.PLAIN, stream=stream, interval=0.0)
    with progress.task("sensitivity", total=4) as bar:
        for node in ("a", "b"):
            bar.advance(status=f"node {node}")
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[start] sensitivity (4 steps)"
    assert lines[1].startswith("[....] sensitivity, 1/4 (25 %), ") and lines[1].endswith("left, node a")
    assert lines[2].startswith("[....] sensitivity, 2/4 (50 %), ")
    assert re.fullmatch(r"\[done\] sensitivity \(2/4, \d+ s\)", lines[3]), lines[3]
    assert len(lines) == 4


def test_plain_lines_need_a_tenth_more_done_or_a_long_quiet() -> None:
    stream = io.StringIO()
    progress.configure(progress.Mode.PLAIN, stream=stream, interval=0.0)
    with progress.task("sensitivity", total=100) as bar:
        for _ in range(30):
            bar.advance()
    middle = [ln for ln in stream.getvalue().splitlines() if ln.startswith("[....]")]
    assert [ln.split(", ")[1] for ln in middle] == ["10/100 (10 %)", "20/100 (20 %)", "30/100 (30 %)"]


def test_plain_lines_are_rate_limited_and_a_failure_is_marked() -> None:
    stream = io.StringIO()
    progress.configure(progress.Mode.PLAIN, stream=stream, interval=3600.0)
    with pytest.raises(RuntimeError), progress.task("search", total=100) as bar:
        for _ in range(50):
            bar.advance()
        raise RuntimeError("boom")
    lines = stream.getvalue().splitlines()
    assert lines == ["[start] search (100 steps)", lines[1]] and lines[1].startswith("[fail] search (50/100, ")


def test_tasks_inside_a_counted_loop_print_nothing_in_plain_mode() -> None:
    stream = io.StringIO()
    progress.configure(progress.Mode.PLAIN, stream=stream, interval=3600.0)
    with progress.task("guard", total=3) as bar:
        for _ in range(3):
            with progress.task("calibration"):
                pass
            bar.advance()
    with progress.task("export"):
        pass
    text = stream.getvalue()
    assert "calibration" not in text
    assert "[start] export" in text and "[done] export" in text


def test_tasks_inside_a_loop_of_unknown_length_print_nothing_in_plain_mode() -> None:
    stream = io.StringIO()
    progress.configure(progress.Mode.PLAIN, stream=stream, interval=3600.0)
    with progress.task("search", loop=True) as bar:
        for _ in range(3):
            with progress.task("calibration"):
                pass
            bar.advance()
    with progress.task("spinner only"), progress.task("inside a task that is no loop"):
        pass
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[start] search" and re.fullmatch(r"\[done\] search \(\d+ s\)", lines[1]), lines
    assert "calibration" not in stream.getvalue()
    assert "[start] inside a task that is no loop" in lines


class _CountingEvent(threading.Event):
    """The plain renderer's stop event, counting the timer's waits: each wait starts after a tick's check."""

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        return super().wait(timeout)


def test_a_silent_step_gets_a_line_every_quiet_limit_in_plain_mode() -> None:
    """A step that never advances (a calibration, a TensorRT build) still writes a line while it runs, for
    the innermost shown task only; none for a task hidden inside a loop, none once it ended."""
    stream = io.StringIO()
    progress.configure(progress.Mode.PLAIN, stream=stream, interval=0.0, quiet_limit=0.3)
    ticks = _CountingEvent()
    progress._renderer.stop = ticks  # type: ignore[attr-defined]  # before any task starts its timer

    def beats() -> list[str]:
        return [ln for ln in stream.getvalue().splitlines() if ln.startswith("[....] ")]

    with progress.task("m_fp16: building"), progress.task("TensorRT build: m_fp16"):
        wait_until(lambda: len(beats()) >= 2, what="two lines for the silent build")
    with progress.task("guard", total=1) as bar, progress.task("calibration"):
        # The timer's line while the hidden calibration runs is the loop's, the innermost task shown.
        wait_until(lambda: any("guard" in ln for ln in beats()), what="a line for the loop around calibration")
        bar.advance()
    ended = len(stream.getvalue().splitlines())
    after = ticks.waits
    wait_until(lambda: ticks.waits >= after + 2, what="two more ticks of the timer")
    lines = stream.getvalue().splitlines()
    progress.configure(progress.Mode.OFF)
    silent = [ln for ln in beats() if "guard" not in ln]
    assert len(silent) >= 2 and all(re.fullmatch(r"\[....\] TensorRT build: m_fp16, \d+ s elapsed", ln)
                                     for ln in silent), lines
    assert not [ln for ln in beats() if "building" in ln or "calibration" in ln], lines
    assert len(lines) == ended  # nothing after the last task ended, though the timer went on ticking


def test_nothing_by_default_and_with_off(capsys: pytest.CaptureFixture[str]) -> None:
    progress.configure(progress.Mode.OFF)
    with progress.task("work", total=2) as bar:
        bar.advance()
        bar.update("halfway", total=3)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_remaining_time_is_unknown_until_something_is_done() -> None:
    task = progress.Task("t", 10, progress._Silent())
    assert task.remaining() is None
    task.advance(5)
    left = task.remaining()
    assert left is not None and 0 <= left <= task.elapsed * 1.01 + 0.01
    assert progress.Task("t", None, progress._Silent()).remaining() is None


def test_mode_follows_the_stream_quiet_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(progress.ENV, "off")
    assert progress.pick_mode(io.StringIO()) is progress.Mode.OFF
    monkeypatch.setenv(progress.ENV, "live")
    assert progress.pick_mode(io.StringIO()) is progress.Mode.LIVE
    assert progress.pick_mode(io.StringIO(), quiet=True) is progress.Mode.OFF
    monkeypatch.setenv(progress.ENV, "sometimes")  # not a mode: chosen by the stream, with a warning
    assert progress.pick_mode(io.StringIO()) is progress.Mode.PLAIN
    monkeypatch.delenv(progress.ENV)
    assert progress.pick_mode(io.StringIO()) is progress.Mode.PLAIN
    assert progress.pick_mode(io.StringIO(), quiet=True) is progress.Mode.OFF
    assert progress.pick_mode(io.StringIO(), enabled=False) is progress.Mode.OFF
    leader, follower = os.openpty()
    try:
        with os.fdopen(follower, "w", closefd=False) as tty:
            assert progress.pick_mode(tty) is progress.Mode.LIVE
            assert progress.pick_mode(tty, quiet=True) is progress.Mode.OFF
    finally:
        os.close(leader)
        os.close(follower)


def test_live_display_on_a_terminal_draws_and_clears() -> None:
    def work(drawn: Callable[[str], None]) -> None:
        with progress.task("calibrating", total=2) as bar:
            bar.advance(status="first")
            progress.echo("INFO builder: a line above the bar")  # the display is redrawn below it
            bar.advance()

    drawn = _live_output(80, work)
    assert "calibrating" in drawn and "a line above the bar" in drawn
    assert "\x1b[" in drawn  # cursor control: the bar is redrawn in place, then removed


def test_trtbuild_prints_plain_progress_when_piped_and_none_with_quiet(tmp_path: Path) -> None:
    """A real build in a fresh interpreter with stderr piped, progress chosen by the terminal check."""
    model = mlp_onnx(tmp_path / "mlp.onnx")
    env = {k: v for k, v in os.environ.items() if k != progress.ENV}
    base = [sys.executable, "-m", "builder"]
    build = ["build", "--onnx", str(model), "--name", "m", "--precision", "fp32", "--repository",
             str(tmp_path / "repo"), "--log", str(tmp_path / "build.log"), "--force"]
    piped = subprocess.run([*base, *build], capture_output=True, text=True, timeout=300, env=env)
    assert piped.returncode == 0, piped.stderr
    lines = piped.stderr.splitlines()
    assert "[start] m_fp32: building" in lines, lines
    assert any(re.fullmatch(r"\[done\] m_fp32: building \(\d+ s\)", ln) for ln in lines), lines
    assert "\x1b[" not in piped.stderr  # no cursor control off a terminal
    quiet = subprocess.run([*base, "-q", *build], capture_output=True, text=True, timeout=300, env=env)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""
    assert "build summary: 1 variant ready" in quiet.stdout  # the result still prints


_END = "<end of frames>"


def _unescaped(raw: bytes) -> str:
    text = raw.decode("utf-8", "replace").replace("\r", "\n")
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


def _live_output(columns: int, work: Callable[[Callable[[str], None]], None]) -> str:
    """Everything a live display writes to a pseudo-terminal `columns` wide while `work` runs (read back
    whole: up to a marker written after it). `work` gets `drawn(text)`, which waits until the display has
    drawn `text` (rich redraws from its own thread)."""
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(leader, 1 << 16)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)

    def drawn(text: str) -> None:
        wait_until(lambda: text in _unescaped(b"".join(chunks)), what=f"{text!r} drawn")

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        with os.fdopen(follower, "w", closefd=False) as tty:
            progress.configure(progress.Mode.LIVE, stream=tty)
            work(drawn)
            progress.configure(progress.Mode.OFF)  # stops rich's refresh thread: nothing is drawn after
            tty.write(_END)
            tty.flush()
        drawn(_END)  # everything written before it has been read back
    finally:
        os.close(follower)
        os.close(leader)
        reader.join(timeout=5)
    return b"".join(chunks).decode("utf-8", "replace").replace(_END, "")


def _live_frames(columns: int, work: Callable[[Callable[[str], None]], None]) -> list[str]:
    """The lines a live display draws (`_live_output`), escape codes removed."""
    text = _unescaped(_live_output(columns, work).encode())
    return [line for line in text.split("\n") if line.strip()]


def _guard_pass(drawn: Callable[[str], None]) -> None:
    with progress.task("efficientnet_lite0_int8: building"), \
            progress.task("INT8 guard: sensitivity, one node quantized at a time", total=61) as bar:
        for node in range(3):
            bar.advance(status=f"/blocks/blocks.{node}/conv/Conv")
            drawn(f"{node + 1}/61")


def test_live_display_keeps_counts_and_times_whole_on_an_80_column_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """The description and status give way on a narrow terminal; the count, elapsed and remaining time do
    not (rich cut those first: `0/… 0:… eta -:-…`)."""
    monkeypatch.delenv("COLUMNS", raising=False)  # rich's override of the terminal's width
    frames = [f for f in _live_frames(80, _guard_pass) if "INT8 guard" in f]
    assert frames, frames
    last = frames[-1]
    assert re.search(r" 3/61 \d:\d\d:\d\d eta (\d:\d\d:\d\d|-:--:--) ", last), last
    assert len(last.rstrip()) <= 80, last


def test_live_display_is_as_wide_as_its_terminal_not_as_descriptor_2(monkeypatch: pytest.MonkeyPatch) -> None:
    """During a build descriptor 2 is the log file: the width comes from the terminal written to (rich's
    own measure assumed 80 columns), up to 120."""
    monkeypatch.delenv("COLUMNS", raising=False)
    wide = [f for f in _live_frames(150, _guard_pass) if "INT8 guard" in f][-1]
    assert "INT8 guard: sensitivity, one node quantized" in wide, wide
    assert "/blocks/blocks.2/conv/Conv" in wide, wide
    assert 80 < len(wide.rstrip()) <= 120, wide
