"""The launcher's CUDA MPS handling (builder/serving/mps.py) against the real daemon, no install needed:

    PYTHONPATH=. python3 bench/gpu/mps_check.py

start() then a CUDA client (torch, where the host python has it) that the daemon's log must name, stop() (its
daemon process gone), a second stop() that finds nothing, this folder's daemon killed with SIGKILL (its stale
socket must not block the next start), and start() again. Prints one JSON line per step; exit status 0 when
every step held. Its run on an H200 (2026-11-29) was of an earlier version, which found the daemons by pgrep."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from builder.serving import mps


def step(name: str, ok: bool, **facts: object) -> bool:
    print(json.dumps({"step": name, "ok": ok} | facts), flush=True)
    return ok


def main() -> int:
    state = Path(tempfile.mkdtemp(prefix="mps-check-"))
    oks = []
    t0 = time.monotonic()
    env = mps.start(state, [0])
    oks.append(step("start", (Path(env["CUDA_MPS_PIPE_DIRECTORY"]) / "control").exists(),
                    seconds=round(time.monotonic() - t0, 2)))
    code = "import torch; x = torch.ones(4, device='cuda'); print(float(x.sum()))"
    client = subprocess.run([sys.executable, "-c", code],
                            env=os.environ | env, capture_output=True, text=True, timeout=120, check=False)
    oks.append(step("client", client.returncode == 0 and mps.clients(state) > 0, clients=mps.clients(state),
                    out=client.stdout.strip()[-80:], err=client.stderr.strip()[-200:]))
    pids = mps.daemon_pids(state)
    t0 = time.monotonic()
    quit_ok = mps.stop(state)
    oks.append(step("stop", quit_ok and bool(pids) and not mps.daemon_pids(state), daemon=pids, returned=quit_ok,
                    seconds=round(time.monotonic() - t0, 2)))
    oks.append(step("stop again", mps.stop(state) is False))
    mps.start(state, [0])
    pids = mps.daemon_pids(state)  # this folder's daemon only: no other daemon on the host is touched
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    stale = (Path(env["CUDA_MPS_PIPE_DIRECTORY"]) / "control").exists()
    t0 = time.monotonic()
    returned = mps.stop(state)
    oks.append(step("stop after SIGKILL", bool(pids) and not mps.daemon_pids(state), killed=pids, socket_left=stale,
                    returned=returned, seconds=round(time.monotonic() - t0, 2)))
    t0 = time.monotonic()
    mps.start(state, [0])
    oks.append(step("start again", len(mps.daemon_pids(state)) == 1, seconds=round(time.monotonic() - t0, 2)))
    oks.append(step("final stop", mps.stop(state) and not mps.daemon_pids(state)))
    return 0 if all(oks) else 1


if __name__ == "__main__":
    sys.exit(main())
