"""A stand-in `nvidia-cuda-mps-control` for tests without a GPU, behaving as the real one did on an H200:
`-d` starts a daemon process (its command line `... nvidia-cuda-mps-control -d`, the environment it was given)
that makes the control socket; `quit` ends it, and it leaves the socket behind; any command without a live
daemon exits non-zero. Every call is logged (first word: `-d` or the command). Knobs, from the environment of
`-d`: STANDIN_HANG=1, the daemon ignores quit (runs until signalled); STANDIN_NO_SOCKET=1, it makes no socket."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from builder.serving import mps
from builder.serving.processes import alive

SCRIPT = '''#!{python}
import os, sys, time
pipe, logs, calls = os.environ["CUDA_MPS_PIPE_DIRECTORY"], os.environ["CUDA_MPS_LOG_DIRECTORY"], os.environ["CALLS"]
alive_file = os.path.join(pipe, ".alive")

def daemon_alive():
    try:
        pid = int(open(alive_file).read())
        os.kill(pid, 0)
        return open("/proc/%d/stat" % pid).read().split(") ")[1][0] != "Z"
    except (OSError, ValueError):
        return False

if sys.argv[1:] == ["-d"]:
    open(calls, "a").write("-d %s %s\\n" % (pipe, os.environ.get("CUDA_VISIBLE_DEVICES", "unset")))
    if os.fork():
        sys.exit(0)
    os.setsid()
    if os.fork():
        os._exit(0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.makedirs(pipe, exist_ok=True)
    open(alive_file, "w").write(str(os.getpid()))
    if not os.environ.get("STANDIN_NO_SOCKET"):
        open(os.path.join(pipe, "control"), "w").close()
    open(os.path.join(logs, "control.log"), "a").write("[t] Starting control daemon using socket %s/control\\n" % pipe)
    while os.path.exists(alive_file) or os.environ.get("STANDIN_HANG"):
        time.sleep(0.02)
    os._exit(0)
cmd = sys.stdin.readline().strip()
open(calls, "a").write("%s %s\\n" % (cmd, pipe))
if not daemon_alive():
    sys.stderr.write("Cannot find MPS control daemon process\\n")
    sys.exit(1)
if cmd == "quit":
    os.unlink(alive_file)
elif cmd == "get_server_list":
    print(4242)
'''


@contextlib.contextmanager
def installed(folder: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The stand-in first on PATH (a GPU host's real one stays behind it); yields the file its calls are logged
    to; afterwards, any stand-in daemon still running is killed."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    control = bin_dir / mps.CONTROL
    control.write_text(SCRIPT.replace("{python}", sys.executable))
    control.chmod(control.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    calls = folder / "calls"
    calls.touch()
    monkeypatch.setenv("CALLS", str(calls))
    for name in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "STANDIN_HANG", "STANDIN_NO_SOCKET"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(mps, "HOST_PIPE", folder / "no-host-daemon")  # a GPU host's own daemon stays out of it
    try:
        yield calls
    finally:
        for pid in daemons_of(bin_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def daemons_of(bin_dir: Path) -> list[int]:
    """Live stand-in daemons run from bin_dir."""
    script = str(bin_dir / mps.CONTROL)
    return [process.pid for process in psutil.process_iter(["cmdline"])
            if script in (process.info["cmdline"] or []) and alive(process.pid)]


def calls_of(log: Path) -> list[str]:
    return [line.split()[0] for line in log.read_text().splitlines()]
