"""Which processes are a state folder's tritonserver and what a dead one left, read through psutil.

Starting records the server in `tritonserver.json` (pid, the process's start time, the argv, ports, repository,
backend folder, the trtbuild command). "Ours and alive" means: the pid exists and is not a zombie, its start time
equals the recorded one (a recycled pid fails this), and its command line is `tritonserver` with this state
folder's `--backend-directory`. The python backend's stubs run the executable copied into
`<state>/backends/python` and carry their /dev/shm region name in their argv; a stub whose parent is no
longer a tritonserver is a leftover of a dead server of this state folder: `clean_leftovers` stops it and
frees its region. The launcher (builder.serving.triton_server) starts and stops servers with these.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from builder.errors import ServerError

log = logging.getLogger(__name__)

STATE_FILE = "tritonserver.json"
LEGACY_PID_FILE = "tritonserver.pid"  # what an earlier version wrote: a bare pid
STUB_NAME = "triton_python_backend_stub"
SHM_REGION = re.compile(r"triton_python_backend_shm_region_[A-Za-z0-9_.-]+")
SHM_DIR = Path("/dev/shm")
# A process that went away, or one of another user's that cannot be read: either way not ours to inspect.
_GONE = (psutil.NoSuchProcess, psutil.AccessDenied)  # ZombieProcess is a NoSuchProcess
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# --- processes ---

def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot: with the pid, it names one process for good. psutil
    gives it as seconds since the epoch (ticks plus the boot time, which moves when the clock is set); the boot
    time taken off again leaves the kernel's figure, unmoved by clock changes and as earlier records hold it."""
    try:
        since_boot = psutil.Process(pid).create_time() - psutil.boot_time()
    except _GONE:
        return None
    return round(since_boot * _CLOCK_TICKS)


def alive(pid: int) -> bool:
    """Running (a zombie has exited: it only waits for its parent to read its status)."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except _GONE:
        return False


def _ppid(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except _GONE:
        return None


def _cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except _GONE:
        return []


def _in_cwd_of(pid: int, path: str) -> Path:
    """A path from a process's argv, made absolute against that process's working folder, symlinks
    resolved (as `Path.resolve()` gives our side of the comparison)."""
    if not os.path.isabs(path):
        with contextlib.suppress(*_GONE):
            path = os.path.join(psutil.Process(pid).cwd(), path)
    return Path(os.path.realpath(path))


def _shown(argv: list[str]) -> str:
    text = " ".join(argv) or "an unreadable command"
    return text if len(text) <= 80 else text[:77] + "..."


def _is_tritonserver(argv: list[str]) -> bool:
    return bool(argv) and Path(argv[0]).name == "tritonserver"


def _backend_dir_of(pid: int, argv: list[str]) -> Path | None:
    for arg in argv:
        if arg.startswith("--backend-directory="):
            return _in_cwd_of(pid, arg.split("=", 1)[1])
    return None


def exited(pid: int, ticks: int | None) -> bool:
    """The process recorded as (pid, start ticks) is gone, even if its pid now names another one."""
    return not alive(pid) or (ticks is not None and start_ticks(pid) != ticks)


def mismatch(pid: int, ticks: int | None, state_dir: Path) -> str | None:
    """None when pid is the live tritonserver of state_dir (started at `ticks` when known), else why not."""
    if not alive(pid):
        return "has exited"
    argv = _cmdline(pid)
    if exited(pid, ticks):
        return f"has exited; the pid now belongs to another process (`{_shown(argv)}`)"
    if not _is_tritonserver(argv):
        return f"is not a tritonserver (it runs `{_shown(argv)}`)"
    backends = _backend_dir_of(pid, argv)
    if backends != (state_dir.resolve() / "backends"):
        return f"is a tritonserver of another state folder (--backend-directory={backends})"
    return None


# --- the record of the server a state folder runs ---

@dataclass(frozen=True)
class ServerRecord:
    """What `.run/tritonserver.json` holds. start_ticks is None for a legacy bare pid file."""

    pid: int
    start_ticks: int | None
    argv: list[str] = field(default_factory=list)
    command: list[str] = field(default_factory=list)  # the trtbuild (or other) invocation that started it
    repository: str = ""
    backend_dir: str = ""
    ports: dict[str, int] = field(default_factory=dict)
    started: str = ""  # ISO time, for people

    @property
    def source(self) -> str:
        return LEGACY_PID_FILE if self.start_ticks is None else STATE_FILE


def read_record(state_dir: Path) -> ServerRecord | None:
    """The recorded server (JSON record, else the previous version's bare pid file), None when none."""
    path = state_dir / STATE_FILE
    if path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if int(data["pid"]) <= 0:  # os.kill(0 or -1, ...) would signal a whole group
                raise ValueError(f"pid {data['pid']} is not a process id")
            return ServerRecord(pid=int(data["pid"]), start_ticks=int(data["start_ticks"]),
                                argv=list(data.get("argv", [])), command=list(data.get("command", [])),
                                repository=str(data.get("repository", "")),
                                backend_dir=str(data.get("backend_dir", "")),
                                ports=dict(data.get("ports", {})), started=str(data.get("started", "")))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable %s: %s", path, exc)
            return None
    legacy = state_dir / LEGACY_PID_FILE
    try:
        pid = int(legacy.read_text().strip())
    except (OSError, ValueError):
        return None
    return ServerRecord(pid=pid, start_ticks=None) if pid > 0 else None


def forget(state_dir: Path, record: ServerRecord | None = None) -> None:
    """Remove the record (only when it still names `record`'s pid, if given) and any legacy pid file."""
    current = read_record(state_dir)
    if record is None or current is None or current.pid == record.pid:
        (state_dir / STATE_FILE).unlink(missing_ok=True)
        (state_dir / LEGACY_PID_FILE).unlink(missing_ok=True)


def running(state_dir: Path) -> ServerRecord | None:
    """The recorded server when it is alive and ours; a stale record is removed (and logged)."""
    record = read_record(state_dir)
    if record is None:
        return None
    why = mismatch(record.pid, record.start_ticks, state_dir)
    if why is None:
        return record
    log.info("pid %d in %s %s: removing the stale record", record.pid, state_dir / record.source, why)
    forget(state_dir, record)
    return None


# --- leftovers of a dead server: python-backend stubs and their shared-memory regions ---

@dataclass(frozen=True)
class Stub:
    pid: int
    region: str | None  # its /dev/shm region name, from its argv


@dataclass(frozen=True)
class Cleanup:
    servers: list[int]  # the dead servers' pids, as the stubs name them
    stubs: list[int]
    regions: list[str]  # the /dev/shm regions they held, gone now (unlinked by the stub or by us)

    def __bool__(self) -> bool:
        return bool(self.stubs or self.regions)

    def line(self, state_dir: Path) -> str:
        return (f"cleaned up after a dead tritonserver of {state_dir} (pid "
                f"{', '.join(map(str, self.servers)) or '?'}): stopped {len(self.stubs)} python-backend "
                f"stub(s) (pid {', '.join(map(str, self.stubs)) or '-'}) and freed their {len(self.regions)} "
                f"shared-memory region(s) in {SHM_DIR}")


def _stub_of(pid: int, argv: list[str], python_dir: Path) -> tuple[Stub, int | None] | None:
    """(stub, the server pid it names) when pid (running argv) is a python-backend stub run from python_dir."""
    if not argv or Path(argv[0]).name != STUB_NAME:
        return None
    try:
        found = psutil.Process(pid).exe()  # "" where the link cannot be read
    except _GONE:
        found = ""
    # After a rename over it, the running executable reads "<path> (deleted)".
    exe = Path(found.removesuffix(" (deleted)")) if found else _in_cwd_of(pid, argv[0])
    # argv: stub, model.py, shm region, shm sizes (2), server pid, backend python folder, ...
    named = [_in_cwd_of(pid, arg) for arg in argv[6:7]]
    if exe.parent != python_dir and python_dir not in named:
        return None
    region = next((arg for arg in argv[1:] if SHM_REGION.fullmatch(arg)), None)
    server = int(argv[5]) if len(argv) > 5 and argv[5].isdigit() else None
    return Stub(pid, region), server


def orphaned_stubs(state_dir: Path) -> tuple[list[Stub], list[int]]:
    """Stubs of state_dir's backend folder whose parent is no longer a tritonserver, and the servers they name."""
    python_dir = state_dir.resolve() / "backends" / "python"
    stubs: list[Stub] = []
    servers: set[int] = set()
    for process in psutil.process_iter(["cmdline"]):
        argv = process.info["cmdline"] or []
        if not argv or Path(argv[0]).name != STUB_NAME or not alive(process.pid):
            continue
        found = _stub_of(process.pid, argv, python_dir)
        if found is None:
            continue
        parent = _ppid(process.pid)
        if parent is not None and alive(parent) and _is_tritonserver(_cmdline(parent)):
            continue  # a live server's stub
        stubs.append(found[0])
        if found[1] is not None:
            servers.add(found[1])
    return stubs, sorted(servers)


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if alive(p)]
    return left


def clean_leftovers(state_dir: Path, timeout: float = 10.0, grace: float = 2.0) -> Cleanup:
    """Stop the orphaned stubs of state_dir (SIGTERM, then SIGKILL) and remove their /dev/shm regions.

    A stub normally notices within about a second that its server is gone and exits, freeing its
    region: `grace` seconds are left for that first (only when there are orphans), so a normal stop
    is not reported as a cleanup."""
    stubs, servers = orphaned_stubs(state_dir)
    if stubs and grace > 0:
        lingering = set(wait_gone([s.pid for s in stubs], grace))
        stubs = [s for s in stubs if s.pid in lingering]
    if not stubs:
        return Cleanup(servers, [], [])
    ticks = {s.pid: start_ticks(s.pid) for s in stubs}
    held = [s.region for s in stubs if s.region and (SHM_DIR / s.region).exists()]
    for sigs in ((signal.SIGTERM, signal.SIGCONT), (signal.SIGKILL,)):  # SIGCONT: a stopped stub takes its TERM
        for stub in stubs:
            if alive(stub.pid) and start_ticks(stub.pid) == ticks[stub.pid]:
                for sig in sigs:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(stub.pid, sig)
        left = wait_gone([s.pid for s in stubs], timeout / 2)
        if not left:
            break
    else:
        raise ServerError(f"python-backend stubs {', '.join(map(str, left))} of a dead tritonserver of "
                          f"{state_dir} did not exit within {timeout:.0f} s; stop them by hand")
    # A stub that takes its SIGTERM unlinks its own region; a killed or hung one leaves it: remove those.
    for region in held:
        with contextlib.suppress(FileNotFoundError):
            (SHM_DIR / region).unlink()
    done = Cleanup(servers, [s.pid for s in stubs], held)
    log.warning("%s", done.line(state_dir))
    return done
