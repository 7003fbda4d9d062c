"""CUDA MPS (NVIDIA's Multi-Process Service) for one state folder's Triton server (`trtbuild serve --mps`).

Why: the python runner's instances are separate processes (python stubs), each with its own CUDA context, and
without MPS the GPU time-slices between the contexts instead of running their kernels at once. On an H200
(docs/results/gpu.md) MPS took FP16 EfficientNet-Lite0 from 0.27x to 0.43x of the in-process ceiling at
concurrency 32 and cut Triton's compute_input (its copies of the requests' GPU inputs, waiting for a time slice)
from about 2200 to 300 µs per batch.

The control daemon is a user-space process: it changes none of the card's settings. It runs with its pipe and
log folders under `<state>/mps`, so only the processes given that environment (this folder's tritonserver and
its stubs) use it; a system-wide daemon, and every other CUDA program, are left alone. A CUDA program that cannot
reach the daemon silently runs without MPS, so start() waits for the daemon's control socket before the server
starts. Quitting it stops its server; every stop of the state folder's server quits it.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

from builder.errors import ServerError

log = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
FOLDER = "mps"


def environment(state_dir: Path) -> dict[str, str]:
    """What a CUDA process needs in its environment to use this folder's daemon."""
    root = state_dir.resolve() / FOLDER
    return {"CUDA_MPS_PIPE_DIRECTORY": str(root / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(root / "log")}


def _control(state_dir: Path, command: str, timeout: float) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([CONTROL], input=command.encode() + b"\n", env=os.environ | environment(state_dir),
                          capture_output=True, timeout=timeout, check=False)


def start(state_dir: Path, gpus: list[int], timeout: float = 10.0) -> dict[str, str]:
    """Start the daemon for state_dir; the environment that reaches it. Refuses in one line where there is no
    GPU or no daemon binary. A daemon a killed server left in the folder is quit first."""
    if not gpus:
        raise ServerError("--mps: no NVIDIA GPU here (NVML lists none); CUDA MPS shares a GPU between processes")
    if shutil.which(CONTROL) is None:
        raise ServerError(f"--mps: {CONTROL} not found on PATH (it comes with the NVIDIA driver's utilities; in a "
                          "container, NVIDIA_DRIVER_CAPABILITIES must include utility); serve without --mps")
    stop(state_dir)
    env = environment(state_dir)
    for path in env.values():
        Path(path).mkdir(parents=True, exist_ok=True)
    done = subprocess.run([CONTROL, "-d"], env=os.environ | env, capture_output=True, timeout=timeout, check=False)
    if done.returncode != 0:
        said = (done.stderr or done.stdout).decode(errors="replace").strip().splitlines()
        raise ServerError(f"--mps: `{CONTROL} -d` exited with status {done.returncode}"
                          + (f": {said[-1]}" if said else "") + f"; see {env['CUDA_MPS_LOG_DIRECTORY']}")
    socket_path = Path(env["CUDA_MPS_PIPE_DIRECTORY"]) / "control"
    deadline = time.monotonic() + timeout
    while not socket_path.exists():
        if time.monotonic() > deadline:
            stop(state_dir)
            raise ServerError(f"--mps: the MPS control daemon made no socket {socket_path} within {timeout:.0f} s; "
                              f"see {env['CUDA_MPS_LOG_DIRECTORY']}/control.log")
        time.sleep(0.05)
    log.info("CUDA MPS control daemon started (pipe %s)", env["CUDA_MPS_PIPE_DIRECTORY"])
    return env


def clients(state_dir: Path) -> int:
    """How many client connections the daemon's log records (0 where it has none)."""
    path = Path(environment(state_dir)["CUDA_MPS_LOG_DIRECTORY"]) / "control.log"
    if not path.is_file():
        return 0
    return sum("NEW CLIENT" in line for line in path.read_text(errors="replace").splitlines())


def stop(state_dir: Path, timeout: float = 30.0) -> bool:
    """Quit the folder's daemon, if one runs (its socket is there); True when one was asked to quit."""
    pipe = Path(environment(state_dir)["CUDA_MPS_PIPE_DIRECTORY"])
    if not (pipe / "control").exists() or shutil.which(CONTROL) is None:
        return False
    try:
        done = _control(state_dir, "quit", timeout)
    except subprocess.TimeoutExpired:
        log.warning("the CUDA MPS control daemon of %s did not answer quit within %.0f s", state_dir, timeout)
        return False
    if done.returncode != 0:  # no daemon behind a stale socket (a killed daemon): nothing to quit
        log.debug("%s quit: status %d", CONTROL, done.returncode)
        (pipe / "control").unlink(missing_ok=True)
        return False
    # The daemon leaves its socket behind as it exits (seen on an H200, driver 580): wait, bounded, until it no
    # longer answers (it exits after its server, which waits for the stopped tritonserver's clients), then
    # remove the socket, so the next start() does not mistake it for a live daemon.
    deadline = time.monotonic() + min(timeout, 10.0)
    while time.monotonic() < deadline:
        try:
            if _control(state_dir, "get_server_list", 5.0).returncode != 0:
                break
        except subprocess.TimeoutExpired:
            pass
        time.sleep(0.1)
    else:
        log.warning("the CUDA MPS control daemon of %s still answered 10 s after quit", state_dir)
    (pipe / "control").unlink(missing_ok=True)
    return True
