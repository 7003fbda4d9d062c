"""TLS on both load paths and their control calls (client.tls): gRPC against the bundled Triton started with
`--grpc-use-ssl` and mutual TLS, HTTP through a local TLS endpoint in front of Triton's HTTP port (Triton's
HTTP front end has no TLS of its own). Certificates come from the `openssl` CLI: a CA, a server certificate
for `triton.test` and 127.0.0.1, a client certificate."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from builder.serving.triton_server import Ports, TritonServer, free_ports
from client.cli import main, parse_config
from client.errors import PerfClientError
from client.grpc_aio import AioChannel, GrpcClient
from client.grpc_h2 import Channel
from client.inputs import InputData, build_payloads
from client.protocol import TRANSPORT_ERRORS, Connection, Protocol, error_kind
from client.tls import Tls
from client.wire import GRPC_INFER_METHOD
from tests.helpers.servers import Endpoints

MODEL = "mlp_fp32"

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("certs")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=perfclient test CA", cwd=d)
    (d / "server.ext").write_text("subjectAltName=DNS:triton.test,DNS:localhost,IP:127.0.0.1\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    # A second CA that signed nothing here: a server certificate never chains to it.
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "other.key", "-out", "other.pem",
             "-days", "2", "-subj", "/CN=another CA", cwd=d)
    return {name: d / name for name in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key",
                                        "other.pem")}


@pytest.fixture(scope="module")
def grpc_tls_server(tiny_repository: tuple[Path, Any], certs: dict[str, Path],
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    repository, _ = tiny_repository
    server = TritonServer(repository, tmp_path_factory.mktemp("tls_state"), Ports(*free_ports(3)), extra_args=[
        "--grpc-use-ssl=true", f"--grpc-server-cert={certs['server.pem']}",
        f"--grpc-server-key={certs['server.key']}", f"--grpc-root-cert={certs['ca.pem']}",
        "--grpc-use-ssl-mutual=true"])
    server.start(timeout=120)
    try:
        yield server
    finally:
        server.stop()


async def _send_and_infer(protocol: Protocol, url: str, tls: Tls,
                          client: GrpcClient = GrpcClient.NATIVE) -> tuple[int, dict[str, Any]]:
    """The model's metadata (control call over TLS), one request sent and one decoded (load path over TLS)."""
    async with await Connection.open(protocol, url, timeout_s=30, tls=tls, grpc_client=client) as conn:
        meta = await conn.model(MODEL)
        prepared = await conn.prepare(MODEL, build_payloads(meta, 1, InputData(), {})[0])
        await conn.send(prepared)
        outputs = await conn.infer(prepared)
        return len(meta.inputs), outputs


@pytest.mark.server
@pytest.mark.parametrize("client", list(GrpcClient))
def test_grpc_over_mutual_tls_with_an_sni_name(grpc_tls_server: TritonServer, certs: dict[str, Path],
                                               client: GrpcClient) -> None:
    tls = Tls(ca_file=certs["ca.pem"], cert_file=certs["client.pem"], key_file=certs["client.key"],
              server_name="triton.test")
    inputs, outputs = asyncio.run(_send_and_infer(Protocol.GRPC, f"127.0.0.1:{grpc_tls_server.ports.grpc}", tls,
                                                  client))
    assert inputs >= 1 and outputs


@pytest.mark.server
@pytest.mark.parametrize("client", ["native", "aio"])
def test_grpc_tls_refusals_are_errors_not_answers(grpc_tls_server: TritonServer, certs: dict[str, Path],
                                                  client: str) -> None:
    # A server certificate that does not chain to the CA given, and a client without its certificate
    # (mutual TLS): the load path's request fails as unavailable with either client, never a hang nor another
    # exception.
    port = grpc_tls_server.ports.grpc

    async def attempt(tls: Tls) -> str:
        channel = (AioChannel(f"127.0.0.1:{port}", method=GRPC_INFER_METHOD, timeout_s=10, tls=tls)
                   if client == "aio" else
                   Channel("127.0.0.1", port, method=GRPC_INFER_METHOD, timeout_s=10, ssl=tls.context("h2"),
                           server_hostname="triton.test"))
        try:
            await channel.send(b"")
        except TRANSPORT_ERRORS as exc:
            return error_kind(exc)
        finally:
            await channel.aclose()
        return "answered"

    assert asyncio.run(attempt(Tls(ca_file=certs["other.pem"], cert_file=certs["client.pem"],
                                   key_file=certs["client.key"], server_name="triton.test"))) == "unavailable"
    assert asyncio.run(attempt(Tls(ca_file=certs["ca.pem"], server_name="triton.test"))) == "unavailable"


async def _tls_front(certs: dict[str, Path], backend: tuple[str, int]) -> asyncio.Server:
    """A TLS endpoint (client certificates required) that relays bytes to a cleartext backend."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(certs["ca.pem"]))
    context.load_cert_chain(str(certs["server.pem"]), str(certs["server.key"]))
    context.verify_mode = ssl.CERT_REQUIRED

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*backend)
        await asyncio.gather(relay(reader, up_writer), relay(up_reader, writer))

    return await asyncio.start_server(on_client, "127.0.0.1", 0, ssl=context)


def test_http_over_mutual_tls_with_an_sni_name(endpoints: Endpoints, certs: dict[str, Path]) -> None:
    host, port = endpoints.http.rsplit(":", 1)

    async def go() -> tuple[int, dict[str, Any]]:
        front = await _tls_front(certs, (host, int(port)))
        try:
            url = f"127.0.0.1:{front.sockets[0].getsockname()[1]}"
            tls = Tls(ca_file=certs["ca.pem"], cert_file=certs["client.pem"], key_file=certs["client.key"],
                      server_name="triton.test")
            return await _send_and_infer(Protocol.HTTP, url, tls)
        finally:
            front.close()

    inputs, outputs = asyncio.run(go())
    assert inputs >= 1 and outputs


def test_missing_tls_files_name_their_flag(tmp_path: Path) -> None:
    with pytest.raises(PerfClientError, match=r"--ssl-grpc-root-certifications-file .*: no such file"):
        Tls(ca_file=tmp_path / "nope.pem", flags=("--ssl-grpc-root-certifications-file",
                                                  "--ssl-grpc-certificate-chain-file", "--ssl-grpc-private-key-file"))


@pytest.mark.server
@pytest.mark.parametrize("client", ["native", "aio"])
def test_perfclient_measures_over_grpc_tls_with_perf_analyzers_flags(
        grpc_tls_server: TritonServer, certs: dict[str, Path], quick_args: list[str], tmp_path: Path,
        client: str) -> None:
    out = tmp_path / "r.json"
    code = main(["-m", MODEL, "-u", f"127.0.0.1:{grpc_tls_server.ports.grpc}", "-i", "grpc", "--concurrency", "2",
                 "--grpc-client", client,
                 "--ssl-grpc-use-ssl", "--ssl-grpc-root-certifications-file", str(certs["ca.pem"]),
                 "--ssl-grpc-certificate-chain-file", str(certs["client.pem"]),
                 "--ssl-grpc-private-key-file", str(certs["client.key"]), "--ssl-server-name", "triton.test",
                 "--power-source", "none", "--json", str(out), *quick_args])
    assert code == 0
    (result,) = json.loads(out.read_text())["results"]
    assert result["requests"] > 0 and result["errors"] == {}


def test_tls_flags_become_the_sessions_tls(certs: dict[str, Path]) -> None:
    session = parse_config(["-m", "a", "-i", "http", "--ssl-https-ca-certificates-file", str(certs["ca.pem"]),
                            "--ssl-https-client-certificate-file", str(certs["client.pem"]),
                            "--ssl-https-private-key-file", str(certs["client.key"]),
                            "--ssl-server-name", "triton.test"]).session
    assert session.tls == Tls(ca_file=certs["ca.pem"], cert_file=certs["client.pem"], key_file=certs["client.key"],
                              server_name="triton.test", flags=session.tls.flags if session.tls else ("", "", ""))
    assert parse_config(["-m", "a"]).session.tls is None
    with pytest.raises(PerfClientError, match=r"--ssl-grpc-\*: not with -i http"):
        parse_config(["-m", "a", "-i", "http", "--ssl-grpc-use-ssl"])
    with pytest.raises(PerfClientError, match="--ssl-https-private-key-file: a private key needs its certificate"):
        parse_config(["-m", "a", "-i", "http", "--ssl-https-private-key-file", str(certs["client.key"])])


def test_a_server_certificate_the_ca_does_not_sign_is_one_line_with_the_reason(certs: dict[str, Path]) -> None:
    # A real user's run (a process of its own, so grpc is imported as the CLI imports it) against a TLS
    # endpoint whose certificate does not chain to --ssl-grpc-root-certifications-file: exit 1, one line on
    # stderr, and it says why. Before: grpc-core's 'Handshake failed' INFO lines came first, and the reason
    # was cut off at 200 characters ('... SSL routines:OPENSSL_').
    import os
    import socket
    import sys
    import time

    (port,) = free_ports(1)
    endpoint = subprocess.Popen(["openssl", "s_server", "-quiet", "-accept", str(port), "-cert",
                                 str(certs["server.pem"]), "-key", str(certs["server.key"]), "-alpn", "h2"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert time.monotonic() < deadline, "openssl s_server did not start listening"
            time.sleep(0.05)
        done = subprocess.run([sys.executable, "-m", "client", "-m", MODEL, "-u", f"127.0.0.1:{port}",
                               "--ssl-grpc-root-certifications-file", str(certs["other.pem"]),
                               "--concurrency", "1", "--power-source", "none"],
                              capture_output=True, text=True, timeout=120,
                              env={k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"})
    finally:
        endpoint.kill()
        endpoint.wait(timeout=30)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"perfclient: error: -u 127.0.0.1:{port}: ") and "CERTIFICATE_VERIFY_FAILED" in lines[0]


def test_http_control_calls_check_the_sni_name_not_the_address(endpoints: Endpoints, certs: dict[str, Path]) -> None:
    # The server's certificate names triton.test only (no IP): with --ssl-server-name triton.test and -u an
    # address, the control calls (tritonclient's aiohttp session) and the load path both connect. Before, the
    # control calls checked the certificate against 127.0.0.1: 'IP address mismatch', cannot reach Triton.
    d = certs["ca.pem"].parent
    (d / "named.ext").write_text("subjectAltName=DNS:triton.test\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "named.key", "-out", "named.csr", "-subj",
             "/CN=triton.test", cwd=d)
    _openssl("x509", "-req", "-in", "named.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "named.pem", "-days", "2", "-extfile", "named.ext", cwd=d)
    named = {**certs, "server.pem": d / "named.pem", "server.key": d / "named.key"}
    host, port = endpoints.http.rsplit(":", 1)

    async def go(server_name: str | None) -> tuple[int, dict[str, Any]]:
        front = await _tls_front(named, (host, int(port)))
        try:
            url = f"127.0.0.1:{front.sockets[0].getsockname()[1]}"
            tls = Tls(ca_file=certs["ca.pem"], cert_file=certs["client.pem"], key_file=certs["client.key"],
                      server_name=server_name)
            return await _send_and_infer(Protocol.HTTP, url, tls)
        finally:
            front.close()

    inputs, outputs = asyncio.run(go("triton.test"))
    assert inputs >= 1 and outputs
    with pytest.raises(PerfClientError, match="IP address mismatch"):  # without the name: the address is checked
        asyncio.run(go(None))
