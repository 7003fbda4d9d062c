"""perfclient --shared-memory against a real Triton: tensors go through registered regions (the answers
prove the server read them, and wrote outputs into them), and no region outlives a run: not after a
normal end, a bad flag, Ctrl-C, or a server killed mid-run."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from builder.serving.triton_server import Ports, TritonServer, free_ports
from builder.spec import ModelSpec
from client.cli import main
from client.http1 import request_bytes
from client.protocol import Connection, Prepared, Protocol
from client.shared_memory import PREFIX, SharedMemory, SharedMemoryPool
from client.wire import grpc_infer_request, http_infer_request
from tests.helpers.servers import Endpoints, served
from tests.helpers.waiting import wait_until

SHM = Path("/dev/shm")
ROOT = Path(__file__).resolve().parents[2]


def leftovers(pid: int) -> list[str]:
    """/dev/shm entries perfclient's process `pid` created that still exist."""
    return sorted(p.name for p in SHM.glob(f"{PREFIX}_{pid}_*"))


def registered(endpoints: Endpoints) -> list[str]:
    """Names of the system shared-memory regions the server holds registered."""
    import tritonclient.http as http_tc

    client = http_tc.InferenceServerClient(url=endpoints.http, network_timeout=10)
    try:
        return [region["name"] for region in client.get_system_shared_memory_status()]
    finally:
        client.close()


def reference(endpoints: Endpoints, model: str, x: NDArray[Any]) -> NDArray[Any]:
    import tritonclient.http as http_tc

    client = http_tc.InferenceServerClient(url=endpoints.http, network_timeout=10)
    try:
        item = http_tc.InferInput("x", list(x.shape), "FP32")
        item.set_data_from_numpy(x)
        out = client.infer(model, [item]).as_numpy("logits")
        assert out is not None
        return out
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_server_reads_inputs_from_and_writes_outputs_to_our_regions(protocol: str,
                                                                         endpoints: Endpoints) -> None:
    x = np.random.default_rng(1).standard_normal((3, 4, 32)).astype(np.float32)
    want = reference(endpoints, "mlp_fp32", x)

    async def through_shared_memory() -> tuple[dict[str, NDArray[Any]], NDArray[Any], list[str]]:
        pool = SharedMemoryPool(SharedMemory("system", 4096), protocol=protocol, url=endpoints.url(protocol))
        try:
            async with await Connection.open(Protocol(protocol), endpoints.url(protocol)) as conn:
                # Inputs only in shared memory, outputs in the answer: the answer proves what the server read.
                inputs_only = pool.layout("mlp_fp32", {"x": x}, outputs=False)
                assert inputs_only.inputs["x"].byte_size == x.nbytes and not inputs_only.outputs
                url = endpoints.url(protocol)
                answered = await conn.infer(_prepared(protocol, url, "mlp_fp32", {"x": x}, inputs_only))
                # Outputs into a region too: the server writes them there, the answer carries none.
                both = pool.layout("mlp_fp32", {"x": x}, outputs=True)
                await conn.send(_prepared(protocol, endpoints.url(protocol), "mlp_fp32", {"x": x}, both))
                written = np.frombuffer(pool.contents(both.outputs["logits"]), np.float32)[: want.size]
                names = pool.region_names
                return answered, written.reshape(want.shape).copy(), names
        finally:
            pool.close()

    answered, written, names = asyncio.run(through_shared_memory())
    np.testing.assert_allclose(answered["logits"], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(written, want, rtol=1e-6, atol=1e-6)
    assert len(names) == 3  # x twice (one region per payload's input), logits once
    assert not set(names) & set(registered(endpoints))  # unregistered on close
    assert leftovers(os.getpid()) == []  # and unlinked


def _prepared(protocol: str, url: str, model: str, arrays: dict[str, NDArray[Any]], layout: Any) -> Prepared:
    if protocol == "grpc":
        return Prepared(model, grpc_infer_request(model, arrays, layout))
    body, headers = http_infer_request(arrays, layout)
    return Prepared(model, request_bytes(url, f"/v2/models/{model}/infer", body, headers), headers)


@pytest.mark.parametrize(("protocol", "processes"), [("grpc", 1), ("http", 1), ("grpc", 2)])
def test_a_run_over_shared_memory_measures_and_leaves_nothing_behind(
    protocol: str, processes: int, endpoints: Endpoints, quick_args: list[str], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # With --processes, the workers send the requests the parent prepared: through the parent's regions.
    before = set(registered(endpoints))
    out_json = tmp_path / "r.json"
    code = main(["-m", "mlp_fp32", "-u", endpoints.url(protocol), "-i", protocol, "-b", "2", "--concurrency", "4",
                 "--processes", str(processes), "--shared-memory", "system", "--power-source", "none",
                 "--json", str(out_json), *quick_args])
    capsys.readouterr()
    assert code == 0
    (result,) = json.loads(out_json.read_text())["results"]
    assert result["errors"] == {} and result["requests"] > 0 and result["throughput"] > 0
    assert set(registered(endpoints)) == before
    assert leftovers(os.getpid()) == []


def test_validated_answers_over_shared_memory_are_compared(
    endpoints: Endpoints, quick_args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    tiny_repository: tuple[Path, list[ModelSpec]],
) -> None:
    from builder.serving.verify import check_models, expected_archive, npz_bytes

    repository, specs = tiny_repository
    checks = [c for c in check_models(specs, repository, {Protocol.GRPC: endpoints.grpc}, samples=4)
              if c.variant == "mlp_fp32"]
    saved = tmp_path / "expected.npz"
    saved.write_bytes(npz_bytes(expected_archive(checks)))
    out_json = tmp_path / "r.json"
    code = main(["-m", "mlp_fp32", "-u", endpoints.grpc, "-b", "2", "--shared-memory", "system",
                 "--validate", str(saved), "--power-source", "none", "--json", str(out_json), *quick_args])
    capsys.readouterr()
    assert code == 0
    (result,) = json.loads(out_json.read_text())["results"]
    assert result["errors"] == {} and result["requests"] > 0
    assert leftovers(os.getpid()) == []


def test_bad_shared_memory_arguments_are_one_line_and_leave_nothing(
    endpoints: Endpoints, quick_args: list[str], capsys: pytest.CaptureFixture[str],
) -> None:
    cases = [
        (["--shared-memory", "gpu"], "--shared-memory 'gpu': expected one of none, system, cuda"),
        (["--shared-memory", "system", "--output-shared-memory-size", "-1"], "--output-shared-memory-size -1"),
        # logits of 2 samples are 2 x 16 FP32 = 128 bytes
        (["--shared-memory", "system", "--output-shared-memory-size", "100"], "needs 128 bytes per answer"),
    ]
    if importlib.util.find_spec("cuda") is None:
        cases.append((["--shared-memory", "cuda"], "--shared-memory cuda: needs cuda-python and an NVIDIA GPU"))
    for args, message in cases:
        code = main(["-m", "mlp_fp32", "-u", endpoints.grpc, "-b", "2", "--power-source", "none", *args,
                     *quick_args])
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert code == 1 and captured.out == "" and len(err) == 1, (args, err)
        assert message in err[0], (args, err)
    assert leftovers(os.getpid()) == []
    assert not [name for name in registered(endpoints) if name.startswith(f"{PREFIX}_{os.getpid()}_")]


def _start_perfclient(url: str, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "client", "-m", "mlp_fp32", "-u", url, "-b", "2", "--concurrency", "4",
            "--shared-memory", "system", "--power-source", "none", "--measurement-interval", "1000",
            "--max-trials", "30", "--stability-percentage", "0.001", "--no-progress", *extra]
    with log.open("wb") as handle:
        return subprocess.Popen(argv, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT)


def _wait_for_regions(process: subprocess.Popen[bytes], log: Path, endpoints: Endpoints) -> list[str]:
    """perfclient's regions once the load has run on them: they exist, and the server has answered 20 more
    requests for the model since the run started (its tensors go through the regions only)."""
    before = served(endpoints.http, "mlp_fp32")

    def loaded() -> list[str]:
        assert process.poll() is None, log.read_text()
        return leftovers(process.pid) if served(endpoints.http, "mlp_fp32") >= before + 20 else []

    return wait_until(loaded, what="load running on perfclient's regions", timeout_s=120, interval_s=0.1)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_and_sigterm_unregister_and_unlink_every_region(signum: signal.Signals, endpoints: Endpoints,
                                                               tmp_path: Path) -> None:
    log = tmp_path / "perfclient.log"
    process = _start_perfclient(endpoints.grpc, log, "--json", str(tmp_path / "r.json"))
    try:
        regions = _wait_for_regions(process, log, endpoints)
        assert set(regions) <= set(registered(endpoints))  # registered while the load runs
        process.send_signal(signum)
        assert process.wait(timeout=60) == 1, log.read_text()  # the run ends as cut short: partial results
        reason = "interrupted (Ctrl-C)" if signum == signal.SIGINT else "terminated (SIGTERM)"
        assert reason in json.loads((tmp_path / "r.json").read_text())["error"]  # its files written
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    assert leftovers(process.pid) == [], log.read_text()
    assert not set(regions) & set(registered(endpoints))


@pytest.mark.server
def test_a_server_killed_mid_run_leaves_no_region_behind(
    tiny_repository: tuple[Path, list[ModelSpec]], tmp_path: Path,
) -> None:
    repository, _ = tiny_repository
    server = TritonServer(repository, tmp_path / "state", Ports(*free_ports(3)))
    server.start(timeout=120)
    log = tmp_path / "perfclient.log"
    process = None
    try:
        process = _start_perfclient(f"127.0.0.1:{server.ports.http}", log, "-i", "http")
        _wait_for_regions(process, log, Endpoints(f"127.0.0.1:{server.ports.grpc}",
                                                  f"127.0.0.1:{server.ports.http}", ""))
        assert server.process is not None
        server.process.kill()  # no goodbye: the server never unregisters or unmaps anything itself
        code = process.wait(timeout=120)
        assert code == 1, log.read_text()
    finally:
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        server.stop()
    assert leftovers(process.pid) == [], log.read_text()


@pytest.mark.server
def test_a_hung_server_costs_one_timeout_not_one_per_region(
    tiny_repository: tuple[Path, list[ModelSpec]], tmp_path: Path,
) -> None:
    from client.shared_memory import CONTROL_TIMEOUT_S

    repository, _ = tiny_repository
    server = TritonServer(repository, tmp_path / "state", Ports(*free_ports(3)))
    server.start(timeout=120)
    assert server.process is not None
    try:
        pool = SharedMemoryPool(SharedMemory("system"), protocol="grpc", url=f"127.0.0.1:{server.ports.grpc}")
        for seed in range(6):
            pool.layout("mlp_fp32", {"x": np.full((2, 4, 32), seed, np.float32)}, outputs=True)
        assert len(pool.region_names) == 7 and len(leftovers(os.getpid())) == 7
        server.process.send_signal(signal.SIGSTOP)  # alive, listening, answering nothing
        try:
            started = time.monotonic()
            pool.close()
            took = time.monotonic() - started
        finally:
            server.process.send_signal(signal.SIGCONT)
        assert took < 2 * CONTROL_TIMEOUT_S, took
        assert leftovers(os.getpid()) == []
    finally:
        server.stop()
