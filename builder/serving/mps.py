"""CUDA MPS (NVIDIA's Multi-Process Service) for one state folder's Triton server (`trtbuild serve`, on by
default where the repository has python-runner models on a GPU and the daemon exists; `--mps`, `--no-mps`).

Why: the python runner's instances are separate processes (python stubs), each with its own CUDA context, and
without MPS the GPU time-slices between the contexts instead of running their kernels at once. On three H200
starts (docs/results/gpu.md) MPS took FP16 EfficientNet-Lite0 from 0.27x to 0.37-0.43x of the in-process
ceiling at concurrency 32 and cut Triton's compute_input (its copies of a batch's GPU inputs, waiting for a time
slice) from about 2200 to 300-400 µs per batch.

The control daemon is a user-space process: it changes none of the card's settings. It runs with its pipe and
log folders under `<state>/mps`, so only the processes given that environment (this folder's tritonserver and
its stubs) use it; a system-wide daemon, and every other CUDA program, are left alone. A CUDA program that cannot
reach the daemon silently runs without MPS, so start() waits for the daemon's control socket before the server
starts. The daemon is known by its environment (an `nvidia-cuda-mps-control -d` process whose
CUDA_MPS_PIPE_DIRECTORY is this folder's), so a hung one can be ended without touching any other daemon.
Callers quit it after the server and its stubs are gone: MPS's server waits for its clients before it exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from builder.errors import ServerError
from builder.repository.triton_config import parse
from builder.serving.processes import alive, wait_gone

log = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
SERVER = "nvidia-cuda-mps-server"  # started by the daemon, with its environment; holds the shared GPU context
FOLDER = "mps"
SOCKET_PATH_MAX = 107  # a Unix socket's path, sun_path less its terminating zero
_CLIENT = re.compile(r"NEW CLIENT (\d+)")


def environment(state_dir: Path) -> dict[str, str]:
    """What a CUDA process needs in its environment to use this folder's daemon."""
    root = state_dir.resolve() / FOLDER
    return {"CUDA_MPS_PIPE_DIRECTORY": str(root / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(root / "log")}


def _socket(state_dir: Path) -> Path:
    return Path(environment(state_dir)["CUDA_MPS_PIPE_DIRECTORY"]) / "control"


def _daemon_env(state_dir: Path) -> dict[str, str]:
    # Without CUDA_VISIBLE_DEVICES: MPS's server numbers the devices it sees, and a client that narrows them
    # with its own CUDA_VISIBLE_DEVICES (the server's) must find them under their usual numbers.
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    return env | environment(state_dir)


def _control(state_dir: Path, command: str, timeout: float) -> int:
    """Send one command to the folder's daemon: the control program's exit status (non-zero: no daemon)."""
    try:
        return subprocess.run([CONTROL], input=command.encode() + b"\n", env=_daemon_env(state_dir),
                              capture_output=True, timeout=timeout, check=False).returncode
    except (OSError, subprocess.TimeoutExpired) as e:
        log.debug("%s %s: %s", CONTROL, command, e)
        return -1


def daemon_pids(state_dir: Path) -> list[int]:
    """The live control daemons of this folder and the MPS servers they started, found by their environment."""
    pipe = environment(state_dir)["CUDA_MPS_PIPE_DIRECTORY"]
    found = []
    for process in psutil.process_iter(["cmdline"]):
        argv = process.info["cmdline"] or []
        names = {Path(a).name for a in argv[:2]}
        if not ((CONTROL in names and "-d" in argv) or SERVER in names):
            continue
        try:
            if process.environ().get("CUDA_MPS_PIPE_DIRECTORY") == pipe and alive(process.pid):
                found.append(process.pid)
        except psutil.Error:  # gone meanwhile, or another user's
            continue
    return found


def _end(pids: list[int], state_dir: Path) -> list[int]:
    """SIGTERM, then SIGKILL, the given daemons of state_dir; those still running after both."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        pids = wait_gone(pids, 5.0)
        if not pids:
            return []
    log.warning("CUDA MPS control daemon(s) %s of %s did not exit after SIGKILL", pids, state_dir)
    return pids


HOST_PIPE = Path("/tmp/nvidia-mps")  # where CUDA looks for a daemon when CUDA_MPS_PIPE_DIRECTORY is unset
# NVIDIA's MPS documentation: Volta and later MPS servers take up to 48 client CUDA contexts per device (fewer
# where each context's memory or CUDA_DEVICE_MAX_CONNECTIONS takes more of the pool).
CLIENTS_PER_GPU = 48


def past_clients(instances: int) -> bool:
    """Whether `instances` python-runner processes on one GPU, with tritonserver's own context, are more than an
    MPS server takes there (those past it fail to load)."""
    return instances + 1 > CLIENTS_PER_GPU


def host_daemon() -> Path | None:
    """The control socket of a live MPS daemon this process's CUDA programs would already reach (the host's, or
    the one CUDA_MPS_PIPE_DIRECTORY names), if there is one. Only a socket that accepts a connection counts: a
    daemon leaves its socket behind when it quits."""
    path = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or HOST_PIPE) / "control"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)  # a Unix connect does not wait: it is accepted, refused or its queue is full
        try:
            probe.connect(str(path))
        except BlockingIOError:  # a listening daemon whose queue is full is a live one
            return path
        except OSError:  # no such path, not a socket, no permission, nobody listening: no daemon to use
            return None
    return path


def gpu_runner_instances(repository: Path, gpus: list[int]) -> dict[int, dict[str, int]]:
    """Per GPU, per model, the python-backend instances (each a process with its own CUDA context) that
    `repository`'s configs start on it (KIND_GPU groups: `count`, at least 1, on each GPU the group lists, else on
    every GPU). A config that does not parse is left to Triton to judge (not counted)."""
    per_gpu: dict[int, dict[str, int]] = {}
    for path in sorted(repository.glob("*/config.pbtxt")):
        try:
            config = parse(path.read_text(encoding="utf-8", errors="replace"))
        except (OSError, text_format.ParseError):
            continue
        for gpu, count in config_gpu_instances(config, gpus).items():
            per_gpu.setdefault(gpu, {})[path.parent.name] = count
    return per_gpu


def config_gpu_instances(config: model_config_pb2.ModelConfig, gpus: list[int]) -> dict[int, int]:
    """Per GPU, the python-backend instances one model's config starts on it (see gpu_runner_instances)."""
    per_gpu: dict[int, int] = {}
    if config.backend != "python":
        return per_gpu
    for group in config.instance_group:
        if group.kind == model_config_pb2.ModelInstanceGroup.KIND_GPU:
            for gpu in list(group.gpus) or gpus or [0]:
                per_gpu[gpu] = per_gpu.get(gpu, 0) + max(group.count, 1)
    return per_gpu


def auto(repository: Path, gpus: list[int]) -> tuple[bool, str | None]:
    """Whether a server of `repository` runs under MPS by default, and why not where it matters (None: nothing
    to say: no python-runner models on a GPU, no GPU, or the host's own daemon serves them). Measured on three
    H200 starts (docs/results/gpu.md): FP16 EfficientNet-Lite0's four instances served 1.35-1.93x the requests
    at concurrency 32 for 0.72-0.88x the joules per inference, and 1.06-1.28x at 256."""
    per_gpu = gpu_runner_instances(repository, gpus)
    if not per_gpu or not gpus:  # without a GPU such models do not load at all: Triton says why
        return False, None
    if (host := host_daemon()) is not None:  # the host's MPS setup: its processes already share the GPU
        log.debug("CUDA MPS: the daemon of %s serves this server's processes; none started", host)
        return False, None
    if shutil.which(CONTROL) is None:
        return False, f"{CONTROL} not found on PATH (it comes with the NVIDIA driver's utilities)"
    gpu, models = max(per_gpu.items(), key=lambda item: sum(item[1].values()))
    held = sum(models.values())
    if past_clients(held):
        largest = sorted(models.items(), key=lambda item: (-item[1], item[0]))
        named = ", ".join(f"{name} {count}" for name, count in largest[:3]) + (", ..." if len(largest) > 3 else "")
        return False, (f"GPU {gpu} would hold {held} python-runner instances ({named}) and the "
                       f"server, more than the {CLIENTS_PER_GPU} clients an MPS server takes per GPU; serve fewer "
                       "instances (models.toml's [model.serving] instances) or spread them with --gpus")
    return True, None


def start(state_dir: Path, gpus: list[int], timeout: float = 10.0) -> dict[str, str]:
    """Start the daemon for state_dir; the environment that reaches it. Refuses in one line where there is no
    GPU or no daemon binary. A daemon a killed server left in the folder is quit first."""
    if not gpus:
        raise ServerError("--mps: no NVIDIA GPU here (NVML lists none); CUDA MPS shares a GPU between processes")
    if shutil.which(CONTROL) is None:
        raise ServerError(f"--mps: {CONTROL} not found on PATH (it comes with the NVIDIA driver's utilities; in a "
                          "container, NVIDIA_DRIVER_CAPABILITIES must include utility); serve without --mps")
    if len(str(_socket(state_dir))) > SOCKET_PATH_MAX:
        raise ServerError(f"--mps: the daemon's socket {_socket(state_dir)} would be longer than a Unix socket's "
                          f"{SOCKET_PATH_MAX} bytes; use a shorter --state-dir")
    stop(state_dir)
    env = environment(state_dir)
    for path in env.values():
        Path(path).mkdir(parents=True, exist_ok=True)
    # One daemon's lines per log: the client count the ready line gives is this daemon's.
    control_log = Path(env["CUDA_MPS_LOG_DIRECTORY"]) / "control.log"
    if control_log.exists():
        control_log.replace(control_log.with_name("control.log.1"))
    try:
        try:
            done = subprocess.run([CONTROL, "-d"], env=_daemon_env(state_dir), capture_output=True,
                                  timeout=timeout, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ServerError(f"--mps: `{CONTROL} -d` did not start: {e}") from None
        if done.returncode != 0:
            said = (done.stderr or done.stdout).decode(errors="replace").strip().splitlines()
            raise ServerError(f"--mps: `{CONTROL} -d` exited with status {done.returncode}"
                              + (f": {said[-1]}" if said else "") + f"; see {env['CUDA_MPS_LOG_DIRECTORY']}")
        deadline = time.monotonic() + timeout
        while not _socket(state_dir).exists():
            if time.monotonic() > deadline:
                raise ServerError(f"--mps: the MPS control daemon made no socket {_socket(state_dir)} within "
                                  f"{timeout:.0f} s; see {control_log}")
            time.sleep(0.05)
    except BaseException:  # refused, timed out or interrupted: no daemon of this folder is left running
        _end(daemon_pids(state_dir), state_dir)
        raise
    log.debug("CUDA MPS control daemon started (pipe %s)", env["CUDA_MPS_PIPE_DIRECTORY"])  # the CLI says it
    return env


def clients(state_dir: Path) -> int:
    """How many processes the current daemon's log names as clients (0 where it has none)."""
    path = Path(environment(state_dir)["CUDA_MPS_LOG_DIRECTORY"]) / "control.log"
    if not path.is_file():
        return 0
    return len(set(_CLIENT.findall(path.read_text(errors="replace"))))


def stop(state_dir: Path, timeout: float = 10.0) -> bool:
    """Quit the folder's daemon, if one is there; True when one was. Call it once the server and its stubs are
    gone (the daemon waits for its clients). One that does not exit within `timeout` is ended by signal."""
    pids = daemon_pids(state_dir)
    sock = _socket(state_dir)
    if not pids and not sock.exists():
        return False
    answered = shutil.which(CONTROL) is not None and sock.exists() and _control(state_dir, "quit", timeout) == 0
    if answered:
        # It leaves its socket behind as it exits (seen on an H200, driver 580): wait, bounded, until no daemon
        # of this folder runs (where none was seen among the processes, until it no longer answers).
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not (daemon_pids(state_dir) if pids else _control(state_dir, "get_server_list", 5.0) == 0):
                break
            time.sleep(0.1)
    left = daemon_pids(state_dir)
    if left:
        log.warning("the CUDA MPS control daemon of %s (pid %s) did not exit after quit; ending it",
                    state_dir, ", ".join(map(str, left)))
        left = _end(left, state_dir)
    # Only now: a socket removed while its daemon still ran would hide that daemon from the next start.
    if not left:
        sock.unlink(missing_ok=True)
    return answered or bool(pids)
