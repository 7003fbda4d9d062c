"""Starting and stopping the Triton Inference Server bundled in the nvidia-pytriton wheel.

That wheel ships `tritonserver` with only the python backend; the backend's stub must match the
running Python, and the server finds this virtualenv's packages (onnxruntime) through PATH.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from builder.errors import ServerError
from client.choices import Choice

log = logging.getLogger(__name__)


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


def prepare_backends(state_dir: Path) -> Path:
    """A backend folder whose python backend carries the stub for this interpreter's version."""
    root = _pytriton_root()
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / py / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServerError(f"tritonserver: no python backend stub for Python {py} in {stub.parent.parent}")
    target = state_dir / "backends" / "python"
    target.mkdir(parents=True, exist_ok=True)
    for item in (root / "backends" / "python").iterdir():
        if item.is_file():
            shutil.copy2(item, target / item.name)
    shutil.copy2(stub, target / stub.name)
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


def check_ports(ports: Ports) -> None:
    for label, port in (("--http-port", ports.http), ("--grpc-port", ports.grpc), ("--metrics-port", ports.metrics)):
        if not 1 <= port <= 65535:
            raise ServerError(f"{label} {port}: expected a port number 1-65535")
        if not port_free(port):
            raise ServerError(f"{label} {port}: port is in use; stop what holds it or choose another port")


def command(repository: Path, ports: Ports, backend_dir: Path, log_file: Path,
            model_control: ModelControl = ModelControl.NONE, extra: list[str] | None = None) -> list[str]:
    return [
        str(binary()),
        f"--model-repository={repository.resolve()}",
        f"--backend-directory={backend_dir}",
        f"--http-port={ports.http}",
        f"--grpc-port={ports.grpc}",
        f"--metrics-port={ports.metrics}",
        "--allow-metrics=true",
        f"--model-control-mode={model_control.value}",
        f"--log-file={log_file.resolve()}",
        "--log-verbose=0",
        "--exit-timeout-secs=10",
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


class TritonServer:
    """A Triton process on loopback ports; `start()` returns once /v2/health/ready answers 200."""

    def __init__(self, repository: Path, state_dir: Path, ports: Ports | None = None,
                 model_control: ModelControl = ModelControl.NONE, extra_args: list[str] | None = None) -> None:
        self.repository = repository
        self.state_dir = state_dir
        self.ports = ports or Ports()
        self.model_control = model_control
        self.extra_args = extra_args or []
        self.log_file = state_dir / "tritonserver.log"
        self.process: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        backend_dir = prepare_backends(self.state_dir)
        return command(self.repository, self.ports, backend_dir, self.log_file, self.model_control, self.extra_args)

    def start(self, timeout: float = 120.0, detach: bool = False) -> None:
        if not self.repository.is_dir():
            raise ServerError(f"--repository {self.repository}: folder not found; run `make engines` first")
        check_ports(self.ports)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        argv = self.argv()
        log.info("starting %s", " ".join(argv))
        stdout = (self.state_dir / "tritonserver.out").open("wb")
        self.process = subprocess.Popen(
            argv, env=environment(), stdout=stdout, stderr=subprocess.STDOUT, start_new_session=detach,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"tritonserver exited with status {self.process.returncode} before it was ready; "
                                  f"see {self.log_file}: {self.log_tail(1)}")
            if ready(self.ports.http):
                log.info("tritonserver ready on http %d, grpc %d, metrics %d",
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

    def stop(self, timeout: float = 30.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> TritonServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_pid(pid_file: Path, timeout: float = 30.0) -> bool:
    """Stop the server recorded in pid_file; False when none was running."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return False
    try:
        os.kill(pid, signal.SIGINT)
    except ProcessLookupError:
        pid_file.unlink(missing_ok=True)
        return False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        os.kill(pid, signal.SIGKILL)
    pid_file.unlink(missing_ok=True)
    return True
