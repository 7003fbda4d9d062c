"""Starting and stopping the Triton Inference Server bundled in the nvidia-pytriton wheel.

That wheel ships `tritonserver` with only the python backend; the backend's stub must match the
running Python, and the server finds this virtualenv's packages (onnxruntime) through PATH.

Lifecycle. A state folder (`.run/` for `trtbuild serve`) belongs to one server at a time. Starting
records the server in `tritonserver.json` (pid, the kernel's start time of that pid, the argv, ports,
repository, backend folder, the trtbuild command), written atomically. "Ours and alive" means: the pid
exists and is not a zombie, its start time equals the recorded one (a recycled pid fails this), and
its command line is `tritonserver` with this state folder's `--backend-directory`. Only such a
process is ever signalled. The python backend's stubs run the executable copied into
`<state>/backends/python` and carry their /dev/shm region name in their argv; a stub whose parent is
no longer a tritonserver is a leftover of a dead server of this state folder (SIGKILL leaves them
running for a long time): starting and stopping find, stop and clean them, and say so.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from builder.errors import BuilderError, ServerError
from builder.repository.lock import LockBusy, exclusive, repository_lock
from builder.repository.staging import clear_leftovers, leftovers
from builder.serving.exposure import Exposure, has_open, hide_key_once_parsed
from builder.spec.untrusted import check_tree
from common import progress
from common.choices import Choice
from common.files import copy_atomic, write_json

log = logging.getLogger(__name__)

STATE_FILE = "tritonserver.json"
LEGACY_PID_FILE = "tritonserver.pid"  # what the previous version wrote: a bare pid
LOCK_FILE = "tritonserver.lock"
STUB_NAME = "triton_python_backend_stub"
STUB_TIMEOUT_S = 300  # seconds the python backend waits on a stub (its default, 30, is too short on a GPU)
# Triton's CUDA memory pool per GPU (its default: 64 MB). GPU inputs (CUDA shared memory) reach python-backend
# stubs through it; 4 instances with batches of 64 images (602 KB each) need 154 MB at once. Measured on an
# H200, FP16 EfficientNet-Lite0, 4 instances, concurrency 256: 6785 infer/s with the default, 9421 with
# 1 GiB (bench/gpu/results/2026-11-22-h200-validate-{pool64,nhwc}.json).
CUDA_POOL_BYTES = 1 << 30


def exit_text(code: int) -> str:
    """How a process ended, from its return code: 'exited (code 1)', or for a signal 'exited (code -11:
    killed by signal 11, SIGSEGV)'."""
    if code >= 0:
        return f"exited (code {code})"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "an unknown signal"
    return f"exited (code {code}: killed by signal {-code}, {name})"


def last_lines(paths: list[Path], count: int) -> list[str]:
    """The last `count` non-blank lines of the files, in order (a missing file adds none)."""
    lines: list[str] = []
    for path in paths:
        with contextlib.suppress(OSError):
            lines += [ln for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    return lines[-count:]


def gpu_ids() -> list[int]:
    """The NVIDIA GPUs NVML lists (none where NVML or nvidia-ml-py is missing)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return list(range(int(pynvml.nvmlDeviceGetCount())))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver, no library: no GPU to give a pool
        return []


def cuda_pool_args(gpus: list[int]) -> list[str]:
    return [f"--cuda-memory-pool-byte-size={gpu}:{CUDA_POOL_BYTES}" for gpu in gpus]
SHM_REGION = re.compile(r"triton_python_backend_shm_region_[A-Za-z0-9_.-]+")
SHM_DIR = Path("/dev/shm")


class ModelControl(Choice):
    """Triton's --model-control-mode: load everything at start, or only what the client asks for."""

    NONE = "none"
    EXPLICIT = "explicit"


@dataclass(frozen=True)
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002


def _pytriton_root() -> Path:
    spec = importlib.util.find_spec("pytriton")  # locating only: importing pytriton needs its own deps
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("tritonserver: nvidia-pytriton is not installed; expected `make install` to add it")
    return Path(next(iter(spec.submodule_search_locations))) / "tritonserver"


def binary() -> Path:
    path = _pytriton_root() / "bin" / "tritonserver"
    if not path.is_file():
        raise ServerError(f"tritonserver: {path} not found in the nvidia-pytriton wheel")
    return path


def library_dir() -> Path:
    """The wheel's bundled shared libraries sit beside the pytriton package (also with pip --target)."""
    return _pytriton_root().parent.parent / "nvidia_pytriton.libs"


def _install(source: Path, target: Path) -> None:
    """Copy source to target by a temporary name and a rename, never by writing over target: a stub of a
    running (or dead but lingering) server executes `target`, and writing into it fails with ETXTBSY.
    A target already equal in size and modification time (the copy keeps them) is left alone."""
    with contextlib.suppress(OSError):
        have, want = target.stat(), source.stat()
        if have.st_size == want.st_size and have.st_mtime_ns == want.st_mtime_ns:
            return
    copy_atomic(source, target, keep_stat=True)


def prepare_backends(state_dir: Path) -> Path:
    """A backend folder whose python backend carries the stub for this interpreter's version."""
    root = _pytriton_root()
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / py / STUB_NAME
    if not stub.is_file():
        raise ServerError(f"tritonserver: no python backend stub for Python {py} in {stub.parent.parent}")
    target = state_dir.resolve() / "backends" / "python"
    target.mkdir(parents=True, exist_ok=True)
    for item in (root / "backends" / "python").iterdir():
        if item.is_file():
            _install(item, target / item.name)
    _install(stub, target / stub.name)
    return target.parent


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(count: int = 3) -> list[int]:
    """Distinct free loopback ports (for tests and tuning servers)."""
    sockets, ports = [], []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sockets.append(sock)
        ports.append(sock.getsockname()[1])
    for sock in sockets:
        sock.close()
    return ports


def check_ports(ports: Ports, host: str = "127.0.0.1") -> None:
    for label, port in (("--http-port", ports.http), ("--grpc-port", ports.grpc), ("--metrics-port", ports.metrics)):
        if not 1 <= port <= 65535:
            raise ServerError(f"{label} {port}: expected a port number 1-65535")
        if not port_free(port, host):
            raise ServerError(f"{label} {port}: port is in use; stop what holds it or choose another port")


def command(repository: Path, ports: Ports, backend_dir: Path, log_file: Path,
            model_control: ModelControl = ModelControl.NONE, extra: list[str] | None = None,
            exposure: Exposure | None = None) -> list[str]:
    """Triton's argv; it binds loopback unless `exposure` names another address (see exposure.py)."""
    return [
        str(binary()),
        f"--model-repository={repository.resolve()}",
        f"--backend-directory={backend_dir.resolve()}",  # absolute: stop and cleanup match on it
        f"--http-port={ports.http}",
        f"--grpc-port={ports.grpc}",
        f"--metrics-port={ports.metrics}",
        *(exposure or Exposure()).args(),
        "--allow-metrics=true",
        f"--model-control-mode={model_control.value}",
        f"--log-file={log_file.resolve()}",
        "--log-verbose=0",
        "--exit-timeout-secs=10",
        # A GPU runner loads a session (and CUDA graph) per batch bucket: up to ~36 s measured on an H100,
        # over the python backend's default 30 s wait for a stub. A later one in `extra` wins (checked).
        f"--backend-config=python,stub-timeout-seconds={STUB_TIMEOUT_S}",
        *cuda_pool_args(gpu_ids()),
        *(extra or []),
    ]


def environment() -> dict[str, str]:
    env = dict(os.environ)
    libs = str(library_dir())
    env["LD_LIBRARY_PATH"] = libs + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    # The python backend's stub imports this interpreter's packages when its bin/ comes first.
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def ready(port: int, host: str = "127.0.0.1", timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/v2/health/ready", timeout=timeout) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


# --- processes, read from /proc (Linux): the kernel's word on what runs, no third-party parsing ---

def _stat_fields(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/<pid>/stat (after the parenthesised name, which may hold spaces)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot: with the pid, it names one process for good."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def alive(pid: int) -> bool:
    """Running (a zombie has exited: it only waits for its parent to read its status)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def _ppid(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0")[:-1]]


def _in_cwd_of(pid: int, path: str) -> Path:
    """A path from a process's argv, made absolute against that process's working folder, symlinks
    resolved (as `Path.resolve()` gives our side of the comparison)."""
    if not os.path.isabs(path):
        with contextlib.suppress(OSError):
            path = os.path.join(os.readlink(f"/proc/{pid}/cwd"), path)
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


def _exited(pid: int, ticks: int | None) -> bool:
    """The process recorded as (pid, start ticks) is gone, even if its pid now names another one."""
    return not alive(pid) or (ticks is not None and start_ticks(pid) != ticks)


def _mismatch(pid: int, ticks: int | None, state_dir: Path) -> str | None:
    """None when pid is the live tritonserver of state_dir (started at `ticks` when known), else why not."""
    if not alive(pid):
        return "has exited"
    argv = _cmdline(pid)
    if _exited(pid, ticks):
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


def _forget(state_dir: Path, record: ServerRecord | None = None) -> None:
    """Remove the record (only when it still names `record`'s pid, if given) and any legacy pid file."""
    current = read_record(state_dir)
    if record is None or current is None or current.pid == record.pid:
        (state_dir / STATE_FILE).unlink(missing_ok=True)
        (state_dir / LEGACY_PID_FILE).unlink(missing_ok=True)


@contextlib.contextmanager
def _state_lock(state_dir: Path, timeout: float = 30.0) -> Iterator[None]:
    """One starter or stopper at a time per state folder (flock: released by the kernel if we die)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    try:
        with exclusive(state_dir / LOCK_FILE, wait_s=timeout, poll_s=0.1):
            yield
    except LockBusy:
        raise ServerError(f"--state-dir {state_dir}: another trtbuild serve or stop held "
                          f"{LOCK_FILE} for {timeout:.0f} s") from None


def running(state_dir: Path) -> ServerRecord | None:
    """The recorded server when it is alive and ours; a stale record is removed (and logged)."""
    record = read_record(state_dir)
    if record is None:
        return None
    why = _mismatch(record.pid, record.start_ticks, state_dir)
    if why is None:
        return record
    log.info("pid %d in %s %s: removing the stale record", record.pid, state_dir / record.source, why)
    _forget(state_dir, record)
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


def _stub_of(pid: int, python_dir: Path) -> tuple[Stub, int | None] | None:
    """(stub, the server pid it names) when pid is a python-backend stub run from python_dir."""
    argv = _cmdline(pid)
    if not argv or Path(argv[0]).name != STUB_NAME:
        return None
    try:  # after a rename over it, the running executable reads "<path> (deleted)"
        exe = Path(os.readlink(f"/proc/{pid}/exe").removesuffix(" (deleted)"))
    except OSError:
        exe = _in_cwd_of(pid, argv[0])
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
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or not alive(pid := int(entry.name)):
            continue
        found = _stub_of(pid, python_dir)
        if found is None:
            continue
        parent = _ppid(pid)
        if parent is not None and alive(parent) and _is_tritonserver(_cmdline(parent)):
            continue  # a live server's stub
        stubs.append(found[0])
        if found[1] is not None:
            servers.add(found[1])
    return stubs, sorted(servers)


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
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
        lingering = set(_wait_gone([s.pid for s in stubs], grace))
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
        left = _wait_gone([s.pid for s in stubs], timeout / 2)
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


def _clear_build_leftovers(repository: Path) -> None:
    """Triton would try to load a dead build's staging folder as a model and refuse to start: remove
    them while no build holds the repository lock; while one does, say so instead of failing later."""
    if not leftovers(repository):
        return
    try:
        with repository_lock(repository, what="serve", wait=False):
            clear_leftovers(repository)
    except BuilderError as exc:
        raise ServerError(f"--repository {repository}: a build is writing it right now; serve once it is done "
                          f"({exc})") from exc


class TritonServer:
    """A Triton process on loopback ports; `start()` returns once /v2/health/ready answers 200.

    The state folder holds one server at a time: start() refuses while the recorded one runs, and
    cleans what a dead one left (see the module docstring)."""

    def __init__(self, repository: Path, state_dir: Path, ports: Ports | None = None,
                 model_control: ModelControl = ModelControl.NONE, extra_args: list[str] | None = None,
                 exposure: Exposure | None = None) -> None:
        self.repository = repository
        self.exposure = exposure or Exposure()  # loopback unless asked
        self.state_dir = state_dir
        self.ports = ports or Ports()
        self.model_control = model_control
        self.extra_args = extra_args or []
        self.log_file = state_dir / "tritonserver.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.record: ServerRecord | None = None
        self.cleaned: Cleanup | None = None  # what start() found of a dead server

    def argv(self) -> list[str]:
        backend_dir = prepare_backends(self.state_dir)
        return command(self.repository, self.ports, backend_dir, self.log_file, self.model_control, self.extra_args,
                       exposure=self.exposure)

    def start(self, timeout: float = 120.0, detach: bool = False) -> None:
        if not self.repository.is_dir():
            raise ServerError(f"--repository {self.repository}: folder not found; run `make engines` first")
        _clear_build_leftovers(self.repository)
        check_tree(self.repository)  # Triton would follow a symlink out of the repository and load what it finds
        with _state_lock(self.state_dir):
            other = running(self.state_dir)
            if other is not None:
                http = other.ports.get("http")
                raise ServerError(f"--state-dir {self.state_dir}: a tritonserver started from here is already "
                                  f"running (pid {other.pid}{f', http :{http}' if http else ''}); "
                                  "stop it with `trtbuild stop` first")
            self.cleaned = clean_leftovers(self.state_dir)
            check_ports(self.ports, self.exposure.host)
            argv = self.argv()
            log.debug("starting %s", " ".join(self.exposure.hide(argv)))
            stdout = (self.state_dir / "tritonserver.out").open("wb")
            try:
                self.process = subprocess.Popen(
                    argv, env=environment(), stdout=stdout, stderr=subprocess.STDOUT, start_new_session=detach,
                )
            finally:
                stdout.close()  # the child holds its own copy (or there is no child)
            pid = self.process.pid
            if self.exposure.key is not None:  # out of /proc/<pid>/cmdline once Triton has its own copy
                process, log_file = self.process, self.log_file
                hide_key_once_parsed(pid, self.exposure.key, lambda: has_open(pid, log_file),
                                     lambda: process.poll() is not None)
            self.record = ServerRecord(
                pid=pid, start_ticks=start_ticks(pid), argv=self.exposure.hide(argv),
                command=[sys.executable, *sys.argv],
                repository=str(self.repository.resolve()), backend_dir=str(self.state_dir.resolve() / "backends"),
                ports=asdict(self.ports), started=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            )
            if self.record.start_ticks is None:  # exited at once; the readiness loop reports why
                self.record = None
            else:
                try:
                    write_json(self.state_dir / STATE_FILE, asdict(self.record))
                except BaseException:
                    # Unrecorded, no `trtbuild stop` could find it: stop it here rather than orphan it.
                    self.record = None
                    self.stop()
                    raise
        deadline = time.monotonic() + timeout
        # Triton answers nothing until it has loaded every model (mode none): a status line meanwhile.
        models = sum(1 for child in self.repository.iterdir() if (child / "config.pbtxt").is_file())
        loading = (f"loading {models} model{'s' if models != 1 else ''}" if self.model_control is ModelControl.NONE
                   else "model control explicit: no model loaded at start")
        with progress.task(f"tritonserver: starting ({loading})"):
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    self._forget()
                    raise ServerError(f"tritonserver exited with status {self.process.returncode} before it was "
                                      f"ready; see {self.log_file}: {self.log_tail(1)}")
                if ready(self.ports.http, self.exposure.host):
                    log.debug("tritonserver ready on http %d, grpc %d, metrics %d",
                              self.ports.http, self.ports.grpc, self.ports.metrics)
                    return
                time.sleep(0.25)
            self.stop()
            raise ServerError(f"tritonserver was not ready within {timeout:.0f} s; see {self.log_file}")

    def log_tail(self, lines: int = 20) -> str:
        text = ""
        for path in (self.log_file, self.state_dir / "tritonserver.out"):
            if path.is_file():
                text += path.read_text(encoding="utf-8", errors="replace")
        errors = [ln for ln in text.splitlines() if ln.startswith(("E", "error", "Error")) or "failed" in ln]
        chosen = errors or text.splitlines()
        return " | ".join(chosen[-lines:]).strip() or "no log output"

    def crash_lines(self, frames: int = 6) -> list[str]:
        """Triton's own report of a fatal signal ('Signal (11) received.' and the first stack frames after
        it, from its stdout), empty when it wrote none."""
        lines = last_lines([self.state_dir / "tritonserver.out"], 400)
        start = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith("Signal (")), None)
        return [] if start is None else [" ".join(ln.split()) for ln in lines[start:start + 1 + frames]]

    def last_lines(self, count: int = 12) -> list[str]:
        """The log's last lines, then what the process wrote to stdout (a crash's stack goes there)."""
        return last_lines([self.log_file, self.state_dir / "tritonserver.out"], count)

    def _forget(self) -> None:
        if self.record is not None:
            _forget(self.state_dir, self.record)
            self.record = None

    def stop(self, timeout: float = 30.0) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("tritonserver (pid %d) did not exit within %.0f s of SIGINT; killing it",
                            self.process.pid, timeout)
                self.process.kill()
                self.process.wait(timeout=timeout)
        self._forget()
        clean_leftovers(self.state_dir)  # a killed (or crashed) server leaves its stubs running

    def __enter__(self) -> TritonServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class Stopped:
    """What stop_recorded did: the server it stopped (None: none was running), the recorded pid that
    had already exited, and what it cleaned."""

    pid: int | None
    cleaned: Cleanup
    exited: int | None = None


def dead_server_lines(state_dir: Path, count: int = 12) -> list[str]:
    """When the server recorded in state_dir has exited (not by `trtbuild stop`, which removes the record):
    a line saying so, then its log's last lines, indented. Empty while it runs or when none is recorded."""
    record = read_record(state_dir)
    if record is None or not _exited(record.pid, record.start_ticks):
        return []
    tail = last_lines([state_dir / "tritonserver.log", state_dir / "tritonserver.out"], count)
    return [f"the tritonserver started from {state_dir} (pid {record.pid}) has exited; the last lines it wrote:",
            *(f"  {line}" for line in tail)]


def stop_recorded(state_dir: Path, timeout: float = 30.0) -> Stopped:
    """Stop the server recorded in state_dir, only when that pid is our live tritonserver.

    A record of an exited server is removed (`exited` says so). A record whose pid is alive but not
    ours (a recycled pid, another program, another folder's server) is refused with a ServerError,
    nothing signalled, and removed: it no longer describes our server. The previous version's bare
    pid file is honoured when its process is a tritonserver with this state folder's backend folder
    (it has no start time to compare). Stubs a dead server left are cleaned in every case."""
    if not state_dir.is_dir():  # nothing was ever started from here (and stop creates nothing)
        return Stopped(None, Cleanup([], [], []))
    with _state_lock(state_dir):
        record = read_record(state_dir)
        if record is None:
            return Stopped(None, clean_leftovers(state_dir))
        if _exited(record.pid, record.start_ticks):  # ours is gone (its pid may serve another now)
            _forget(state_dir, record)
            return Stopped(None, clean_leftovers(state_dir), exited=record.pid)
        why = _mismatch(record.pid, record.start_ticks, state_dir)
        if why is not None:
            _forget(state_dir, record)
            raise ServerError(f"pid {record.pid} in {state_dir / record.source} {why}: not signalled; "
                              "removed the stale record")
        ticks = start_ticks(record.pid)
        with contextlib.suppress(ProcessLookupError):  # it may exit between the check and the signal
            os.kill(record.pid, signal.SIGINT)
        if _wait_gone([record.pid], timeout):
            if start_ticks(record.pid) == ticks:  # still the same process
                log.warning("tritonserver (pid %d) did not exit within %.0f s of SIGINT; killing it",
                            record.pid, timeout)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(record.pid, signal.SIGKILL)
            if _wait_gone([record.pid], 10.0):
                raise ServerError(f"tritonserver (pid {record.pid}) did not exit after SIGKILL")
        _forget(state_dir, record)
        return Stopped(record.pid, clean_leftovers(state_dir))
