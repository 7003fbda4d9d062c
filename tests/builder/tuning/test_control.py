"""builder/tuning/control.py: tune's control requests through tritonclient; failures are one line naming the
URL, and calls from short-lived threads leave nothing of gevent's behind."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf import json_format

from builder.errors import ServerError
from builder.repository import triton_config
from builder.serving.triton_server import ModelControl, Ports, TritonServer, free_ports
from builder.tuning import control
from builder.tuning.control import Http, Rejected, tls_missing


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def explicit(repo_copy: Path, tmp_path: Path) -> Iterator[str]:
    """HOST:PORT of a Triton with explicit model control over a copy of the tiny repository (nothing loaded)."""
    http, grpc, metrics = free_ports(3)
    server = TritonServer(repo_copy, tmp_path / "state", Ports(http, grpc, metrics),
                          model_control=ModelControl.EXPLICIT)
    server.start(timeout=120)
    try:
        yield f"127.0.0.1:{http}"
    finally:
        server.stop()


@pytest.mark.server
def test_a_rejected_load_is_one_line_with_the_url_and_tritons_error_text(explicit: str, repo_copy: Path) -> None:
    (repo_copy / "mlp_fp32" / "1" / "model.onnx").write_bytes(b"not an ONNX file")
    http = Http(f"http://{explicit}/")  # a scheme and a slash are taken too
    http.ready()  # before a model fails to load: then Triton (strict readiness) says it is not ready
    with pytest.raises(Rejected) as rejected:
        http.load("mlp_fp32")
    message = str(rejected.value)
    assert message.startswith(f"http://{explicit}/v2/repository/models/mlp_fp32/load: HTTP 400: ")
    # Triton's own text, from its {"error": ...} answer: the model, and why the runner failed to load it
    assert "load failed for model 'mlp_fp32'" in message and "INVALID_PROTOBUF" in message
    assert "\n" not in message  # the python stub's stack frames come on one line
    # Config overrides (JSON, as tune sends them): one Triton refuses (preferred batch sizes 4 and 8 above
    # max_batch_size), and one it loads.
    config = triton_config.parse((repo_copy / "mlp_int8" / "config.pbtxt").read_text())
    config.max_batch_size = 2
    with pytest.raises(Rejected, match=rf"^http://{explicit}/v2/repository/models/mlp_int8/load: HTTP 5\d\d: "
                                       r"failed to load 'mlp_int8'"):
        http.load("mlp_int8", json_format.MessageToJson(config, preserving_proto_field_name=True))
    config.max_batch_size = 8
    config.instance_group[0].count = 2
    http.load("mlp_int8", json_format.MessageToJson(config, preserving_proto_field_name=True))
    assert {m["name"]: m.get("state") for m in http.index()}.get("mlp_int8") == "READY"
    http.unload("mlp_int8")
    assert {m["name"]: m.get("state") for m in http.index()}.get("mlp_int8") != "READY"
    assert http.live()


def test_no_server_is_a_server_error_naming_the_url() -> None:
    port = free_ports(1)[0]
    http = Http(f"127.0.0.1:{port}")
    with pytest.raises(ServerError, match=rf"^http://127.0.0.1:{port}/v2/repository/models/m/load: no answer \("
                       ) as failed:
        http.load("m", timeout=5.0)
    assert not isinstance(failed.value, Rejected)  # no answer is not the server refusing the model
    with pytest.raises(ServerError, match=rf"^http://127.0.0.1:{port}/v2/health/ready: no answer"):
        http.ready()
    assert not http.live()


def test_calls_from_short_lived_threads_leave_no_descriptors_open() -> None:
    # gevent gives each thread that does I/O a hub (an event loop: 2 descriptors) that outlives the thread
    # unless destroyed; the tuner makes each load and unload in a thread of its own.
    http = Http(f"127.0.0.1:{free_ports(1)[0]}")
    answers: list[bool] = []
    http.live()  # the main thread's hub, which stays, exists before counting
    before = open_descriptors()
    threads = 20
    for _ in range(threads):
        worker = threading.Thread(target=lambda: answers.append(http.live()))
        worker.start()
        worker.join(timeout=30)
    assert answers == [False] * threads
    assert open_descriptors() - before < threads  # a hub left per thread would be 2 * threads


class _Listener:
    """A loopback socket that records the first bytes each connection sends, and answers `reply` (if any)."""

    def __init__(self, reply: bytes | None = None) -> None:
        import socket

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = b""
        self.reply = reply
        self.got = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    self.received += conn.recv(65536)
                    if self.reply is not None:
                        conn.sendall(self.reply)
                except OSError:
                    pass
                self.got.set()

    def close(self) -> None:
        self.sock.close()


@pytest.mark.skipif(tls_missing() is not None, reason=f"no TLS in tritonclient's HTTP client here: {tls_missing()}")
def test_an_https_url_stays_https_and_the_admin_key_never_crosses_in_clear_text() -> None:
    listener = _Listener()  # speaks no TLS: a client that stays on https fails the handshake
    try:
        with pytest.raises(ServerError) as caught:
            Http(f"https://127.0.0.1:{listener.port}", key="s3cret-admin-key").ready(timeout=5)
        assert listener.got.wait(5)
        assert b"s3cret-admin-key" not in listener.received and b"GET /v2" not in listener.received
        assert str(caught.value).startswith(f"https://127.0.0.1:{listener.port}/v2/health/ready: ")
        assert "\n" not in str(caught.value)
    finally:
        listener.close()


def test_https_where_the_http_client_has_no_tls_is_one_line_and_opens_no_connection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Python 3.12 (the GPU hosts'): geventhttpclient 2.0.2, the newest tritonclient 2.50 admits, defines no TLS
    pool there, and the client died with an ImportError traceback. Now one line when the URL is given, and no
    client is even made (so nothing, the admin key least of all, can go out in clear text)."""
    monkeypatch.delattr(control.connectionpool, "SSLConnectionPool", raising=False)
    made: list[object] = []
    monkeypatch.setattr(control.httpclient, "InferenceServerClient", lambda *a, **k: made.append(a))
    with pytest.raises(ServerError) as caught:
        Http("https://127.0.0.1:8000", key="s3cret-admin-key")
    message = str(caught.value)
    assert message.startswith("https://127.0.0.1:8000: cannot use https here: geventhttpclient ")
    assert "ssl.match_hostname" in message and "\n" not in message
    assert made == []


def test_a_scheme_other_than_http_is_one_line() -> None:
    with pytest.raises(ServerError, match=r"^ftp://h:1: expected http://HOST:PORT, https://HOST:PORT or HOST:PORT$"):
        Http("ftp://h:1")


def test_an_answer_that_is_not_tritons_json_is_one_line_not_a_traceback() -> None:
    page = b"<html>a proxy's page</html>"
    listener = _Listener(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: %d\r\n"
                         b"Connection: close\r\n\r\n%s" % (len(page), page))
    try:
        with pytest.raises(ServerError, match=r"/v2/repository/index: not a Triton answer"):
            Http(f"127.0.0.1:{listener.port}").index(timeout=5)
    finally:
        listener.close()
