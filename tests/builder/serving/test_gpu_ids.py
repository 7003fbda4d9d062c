"""`trtbuild serve` asks NVML which GPUs get a CUDA memory pool each time it builds Triton's command line. On a
host without a GPU (CI), without the NVML library or without nvidia-ml-py, that question must answer "none"
quickly and print nothing, not slow or break the server's start."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# The DeprecationWarning that protobuf's upb extension gives on import under newer Python 3.12 releases.
PROTOBUF_UPB = "Type google._upb._message."  # -W matches the start of the message, literally

PROBE = """
import json, sys, time
{setup}
t0 = time.perf_counter()
from builder.serving.triton_server import cuda_pool_args, gpu_ids
t1 = time.perf_counter()
first = gpu_ids()
t2 = time.perf_counter()
again = gpu_ids()
t3 = time.perf_counter()
sys.stdout.write(json.dumps({{"ids": [first, again], "pool": cuda_pool_args(first), "import_s": t1 - t0,
                             "call_s": t2 - t1, "again_s": t3 - t2}}))
"""


def _nvml_inits() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:  # noqa: BLE001 - library missing, driver missing: no NVML here
        return False


@pytest.mark.parametrize("setup", ["", "sys.modules['pynvml'] = None  # nvidia-ml-py not installed"],
                         ids=["nvml-library-missing", "nvidia-ml-py-missing"])
def test_no_gpu_answers_none_silently_and_fast(setup: str) -> None:
    if not setup and _nvml_inits():
        pytest.skip("NVML answers on this host")
    # Every warning is an error, except one that protobuf's C extension raises on import under newer Python 3.12
    # point releases (the GPU hosts'): it says nothing about our probe. A later -W takes precedence.
    done = subprocess.run([sys.executable, "-W", "error", "-W", f"ignore:{PROTOBUF_UPB}:DeprecationWarning",
                           "-c", PROBE.format(setup=setup)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    got = json.loads(done.stdout)
    assert got["ids"] == [[], []] and got["pool"] == []
    # Measured here: 16 ms for the first call (importing pynvml, failing to load the library), 0.1 ms after.
    # Bounded by what the same process took to import the server module just before, plus a floor: a loaded
    # machine slows both alike, while a wait on a driver or a timeout would stand out.
    assert got["call_s"] < 0.5 + got["import_s"] and got["again_s"] < 0.05 + got["import_s"], got
