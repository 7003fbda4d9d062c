"""Where the bundled Triton listens and who may use its restricted APIs, against the real tritonserver:
loopback by default; exposed with `--listen`, the repository API answers 403 without the admin key and
200 with it over HTTP and gRPC; the key is in no process's command line and in no log or record."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from builder.cli import main
from builder.errors import ServerError
from builder.serving.exposure import (
    GRPC_KEY_HEADER,
    HIDDEN,
    KEY_ENV,
    KEY_HEADER,
    Exposure,
    exposure,
    read_key_file,
    scrub_argv,
)
from builder.serving.processes import read_record
from builder.serving.triton_server import ModelControl, Ports, TritonServer, free_ports
from builder.tuning.control import Http, Rejected

KEY = "test-admin-key-0123456789abcdef"


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket pid listens on, from /proc/net/tcp{,6} (the kernel's word)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = cols[1].split(":")
            raw = bytes.fromhex(hex_addr)
            # the kernel prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
            family = socket.AF_INET if width == 4 else socket.AF_INET6
            address = socket.inet_ntop(family, raw)
            # gRPC listens on an IPv6 socket bound to the IPv4-mapped address (::ffff:127.0.0.1): the same
            # IPv4 address
            found.append((address.removeprefix("::ffff:") if "." in address else address, int(hex_port, 16)))
    return found


def repository_index(port: int, key: str | None) -> int:
    headers = {KEY_HEADER: key} if key else {}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v2/repository/index", data=b"{}",
                                     headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.fixture
def empty_repository(tmp_path: Path) -> Path:
    folder = tmp_path / "repo"
    folder.mkdir()
    return folder


@pytest.mark.server
def test_the_default_server_listens_on_loopback_only(empty_repository: Path, tmp_path: Path) -> None:
    ports = Ports(*free_ports(3))
    with TritonServer(empty_repository, tmp_path / "state", ports, model_control=ModelControl.EXPLICIT) as server:
        assert server.process is not None
        sockets = listening(server.process.pid)
        # and the unrestricted repository API is there for this host's own tools
        assert repository_index(ports.http, None) == 200
    assert {port for _, port in sockets} == {ports.http, ports.grpc, ports.metrics}
    assert {address for address, _ in sockets} == {"127.0.0.1"}


@pytest.mark.server
def test_exposed_the_restricted_apis_need_the_key_which_no_one_can_read(
        empty_repository: Path, state: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    http, grpc, metrics = free_ports(3)
    assert main(["serve", "--background", "--repository", str(empty_repository), "--state-dir", str(state),
                 "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                 "--model-control", "explicit", "--listen", "0.0.0.0", "--timeout", "120"]) == 0
    out = capsys.readouterr().out
    assert f"listening on 0.0.0.0 (beyond this host): the model-repository, shared-memory, logging, trace APIs " \
           f"need the header {KEY_HEADER} (key from ${KEY_ENV})" in out
    record = read_record(state)
    assert record is not None
    # gRPC takes 0.0.0.0 as every interface of both families (::)
    assert {address for address, _ in listening(record.pid)} <= {"0.0.0.0", "::"}

    assert repository_index(http, None) == 403
    assert repository_index(http, "wrong-key-0123456789") == 403
    assert repository_index(http, KEY) == 200
    # `trtbuild tune --url` sends it on its repository requests
    assert Http(f"127.0.0.1:{http}", KEY).index() == []
    with pytest.raises(Rejected, match=rf"^http://127.0.0.1:{http}/v2/repository/index: HTTP 403: "):
        Http(f"127.0.0.1:{http}").index()

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
    with pytest.raises(InferenceServerException, match=GRPC_KEY_HEADER):
        client.get_model_repository_index()
    with pytest.raises(InferenceServerException, match=GRPC_KEY_HEADER):
        client.get_model_repository_index(headers={GRPC_KEY_HEADER: "wrong-key-0123456789"})
    assert client.get_model_repository_index(headers={GRPC_KEY_HEADER: KEY}) is not None
    assert client.is_server_ready()  # health stays open: probes need no key
    client.close()

    ps = subprocess.run(["ps", "-eo", "pid,args", "ww"], capture_output=True, text=True, check=True, timeout=30)
    assert str(record.pid) in ps.stdout and KEY not in ps.stdout
    assert KEY.encode() not in Path(f"/proc/{record.pid}/cmdline").read_bytes()
    assert any(HIDDEN in arg for arg in record.argv)
    for path in state.rglob("*"):
        if path.is_file() and path.suffix in (".log", ".out", ".json"):
            assert KEY not in path.read_text(errors="replace"), path
    assert KEY not in out


def test_a_key_file_others_can_read_or_a_symlink_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_text(KEY + "\n")
    path.chmod(0o644)
    with pytest.raises(ServerError, match="chmod 600"):
        read_key_file(path)
    path.chmod(0o600)
    assert read_key_file(path) == KEY
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(ServerError, match="symlinks are refused"):
        read_key_file(link)
    path.write_text("short")
    with pytest.raises(ServerError, match="16-256 characters"):
        read_key_file(path)


def test_without_a_key_serve_makes_one_only_its_owner_can_read(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    exposed, source = exposure("0.0.0.0", state_dir=tmp_path)
    assert exposed.key is not None and source is not None and "admin-key" in source
    assert (tmp_path / "admin-key").stat().st_mode & 0o777 == 0o600
    assert read_key_file(tmp_path / "admin-key") == exposed.key
    assert exposure("127.0.0.1", state_dir=tmp_path) == (Exposure("127.0.0.1"), None)
    assert exposure("0.0.0.0", restrict=False) == (Exposure("0.0.0.0"), None)
    with pytest.raises(ServerError, match="expected an IPv4 address"):
        exposure("example.com")


@pytest.mark.server
def test_no_restrict_says_what_it_leaves_open(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The repository does not exist: serve stops after the warning, before starting anything.
    assert main(["serve", "--repository", str(tmp_path / "missing"), "--state-dir", str(tmp_path / "run"),
                 "--listen", "0.0.0.0", "--no-restrict"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("warning: listening on 0.0.0.0 with --no-restrict: anyone who reaches it can load")


def test_the_key_is_hidden_in_recorded_argv_and_scrubbed_from_a_live_process() -> None:
    exposed = Exposure("0.0.0.0", KEY)
    args = exposed.args()
    assert f"--http-restricted-api=model-repository,shared-memory,logging,trace:{KEY_HEADER}={KEY}" in args
    assert "--metrics-address=0.0.0.0" in args
    assert all(KEY not in arg for arg in exposed.hide(args))
    assert KEY not in repr(exposed)
    child = subprocess.Popen([sys.executable, "-c", "print('up', flush=True); import sys; sys.stdin.read()",
                              f"--k={KEY}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"up\n"
        assert scrub_argv(child.pid, KEY)
        assert KEY.encode() not in Path(f"/proc/{child.pid}/cmdline").read_bytes()
    finally:
        child.communicate(b"", timeout=10)
