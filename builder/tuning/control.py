"""Triton's repository and health API for control requests (load with a config override, unload, health),
through tritonclient's HTTP client."""

from __future__ import annotations

import http.client
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any, TypeVar

import gevent
import gevent.ssl
import tritonclient.http as httpclient
from geventhttpclient import connectionpool
from tritonclient.utils import InferenceServerException

from builder.errors import ServerError
from builder.serving.exposure import KEY_HEADER

T = TypeVar("T")

# How long a connection may take to open, whatever the request: a server that is up accepts at once, and a
# load's minutes are spent waiting for the answer (network_timeout), not connecting.
CONNECT_TIMEOUT_S = 10.0
MAX_ERROR_CHARS = 600  # of Triton's error text (a python-backend model's traceback can be long)


def tls_missing() -> str | None:
    """Why tritonclient's HTTP client cannot speak TLS in this interpreter, or None where it can. geventhttpclient
    defines its TLS pool only where ssl.match_hostname exists, which Python 3.12 removed, and tritonclient 2.50
    admits no geventhttpclient newer than 2.0.2, which predates the fix."""
    if hasattr(connectionpool, "SSLConnectionPool"):
        return None
    return (f"geventhttpclient {version('geventhttpclient')} (the newest tritonclient {version('tritonclient')} "
            f"admits) has no TLS under Python {sys.version_info.major}.{sys.version_info.minor} (it needs "
            "ssl.match_hostname, which Python 3.12 removed); use a plain http:// URL to a server on loopback")


class Rejected(ServerError):
    """The server answered a repository request with an error (a model that does not load)."""


class Http:
    """Triton's HTTP API for control requests: every failure is one line naming the URL.

    Each call opens its own tritonclient client and closes it: a client's timeouts are fixed when it is
    made (a liveness probe waits 5 s, a load 5 minutes), control calls are few (one load and one unload per
    point), and the tuner makes them from more than one thread (LocalTarget runs loads in a watched worker
    thread), which gevent's connection pool must not be shared across.
    """

    def __init__(self, base: str, key: str | None = None) -> None:
        scheme, sep, rest = base.partition("://")
        scheme = scheme.lower() if sep else "http"
        if scheme not in ("http", "https"):
            raise ServerError(f"{base}: expected http://HOST:PORT, https://HOST:PORT or HOST:PORT")
        self.address = (rest if sep else base).rstrip("/")  # HOST:PORT: tritonclient takes the scheme as ssl=
        # https stays https, its certificate checked: the admin key must not cross the network in clear text.
        self.tls = scheme == "https"
        self.base = f"{scheme}://{self.address}"
        self.key = key  # the admin key of a server whose repository API is restricted (exposure.py)
        # Refused when made, before any call: never fall back to clear text (the admin key), and say why here
        # rather than as the first call's failure ("not ready").
        if self.tls and (missing := tls_missing()) is not None:
            raise ServerError(f"{self.base}: cannot use https here: {missing}")

    def _call(self, path: str, call: Callable[[Any, dict[str, str] | None], T], *, timeout: float) -> T:
        url = f"{self.base}{path}"
        headers = {KEY_HEADER: self.key} if self.key else None
        try:
            tls: dict[str, Any] = {"ssl": True, "ssl_context_factory": gevent.ssl.create_default_context} \
                if self.tls else {}
            with httpclient.InferenceServerClient(self.address, connection_timeout=min(timeout, CONNECT_TIMEOUT_S),
                                                  network_timeout=timeout, **tls) as client:
                return call(client, headers)
        except InferenceServerException as exc:  # Triton answered with an error status and {"error": "..."}
            text = " ".join(str(exc.message() or "").split())[:MAX_ERROR_CHARS]  # one line
            status = f"HTTP {exc.status()}: " if exc.status() else ""
            raise Rejected(f"{url}: {status}{text}") from exc
        except (OSError, http.client.HTTPException) as exc:  # refused, timed out, closed without an answer
            raise ServerError(f"{url}: no answer ({str(exc) or type(exc).__name__})") from exc
        except ValueError as exc:  # an answer that is not Triton's JSON (a proxy's page, another service)
            raise ServerError(f"{url}: not a Triton answer ({exc})") from exc
        finally:
            _drop_thread_hub()

    def load(self, model: str, config: str | None = None, *, timeout: float = 300.0) -> None:
        """Load (or reload) `model`; `config`: the model config as JSON, used instead of its config.pbtxt."""
        self._call(f"/v2/repository/models/{model}/load",
                   lambda client, headers: client.load_model(model, headers=headers, config=config), timeout=timeout)

    def unload(self, model: str, *, timeout: float = 120.0) -> None:
        self._call(f"/v2/repository/models/{model}/unload",
                   lambda client, headers: client.unload_model(model, headers=headers), timeout=timeout)

    def index(self, *, timeout: float = 30.0) -> list[dict[str, Any]]:
        """The repository index: a dict per model (name, version, state, reason)."""
        models = self._call("/v2/repository/index",
                            lambda client, headers: client.get_model_repository_index(headers=headers),
                            timeout=timeout)
        return [m for m in models or [] if isinstance(m, dict)]

    def ready(self, *, timeout: float = 10.0) -> None:
        """Raise ServerError unless the server is ready (tritonclient answers False for a non-200 status)."""
        path = "/v2/health/ready"
        if not self._call(path, lambda client, headers: client.is_server_ready(headers=headers), timeout=timeout):
            raise ServerError(f"{self.base}{path}: not ready")

    def live(self) -> bool:
        try:
            return bool(self._call("/v2/health/live",
                                   lambda client, headers: client.is_server_live(headers=headers), timeout=5.0))
        except ServerError:
            return False


def _drop_thread_hub() -> None:
    """Destroy the gevent hub that tritonclient's HTTP client made in a thread other than the main one.

    gevent gives every thread that does I/O through it a hub of its own (an event loop holding 2 file
    descriptors, and a resolver thread pool) which outlives the thread: measured here, 50 short-lived threads
    that each made one request left 100 descriptors open. The tuner's load threads are such threads, one per
    load and unload. The main thread's hub stays: it lives as long as the process, and verify and perfclient
    share it. No gevent API here patches anything (no gevent.monkey)."""
    if threading.current_thread() is not threading.main_thread():
        gevent.get_hub().destroy(destroy_loop=True)


@dataclass(frozen=True)
class Endpoints:
    """A running Triton: its HTTP (repository API), gRPC (measured) and metrics addresses."""

    http: str  # HOST:PORT
    grpc: str  # HOST:PORT
    metrics: str | None = None  # http://HOST:PORT/metrics; None: the gRPC host's port 8002
    key: str | None = field(default=None, repr=False)  # sent as triton-admin-key on repository requests
