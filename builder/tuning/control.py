"""Triton's HTTP repository API for control requests (load with a config override, unload, health)."""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from builder.errors import ServerError
from builder.serving.exposure import KEY_HEADER


class Rejected(ServerError):
    """The server answered a repository request with an error (a model that does not load)."""

class Http:
    """Triton's HTTP API for control requests: every failure is one line naming the URL."""

    def __init__(self, base: str, key: str | None = None) -> None:
        self.base = base.rstrip("/") if "://" in base else f"http://{base.rstrip('/')}"
        self.key = key  # the admin key of a server whose repository API is restricted (exposure.py)

    def request(self, path: str, body: dict[str, Any] | None = None, *, timeout: float = 30.0) -> Any:
        url = f"{self.base}{path}"
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **({KEY_HEADER: self.key} if self.key else {})}
        request = urllib.request.Request(url, data=data, method="GET" if data is None else "POST", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                payload = response.read()
        except urllib.error.HTTPError as exc:
            text = exc.read()[:600].decode("utf-8", "replace")
            with contextlib.suppress(ValueError, AttributeError):  # Triton's {"error": "..."}
                text = str(json.loads(text).get("error", text))
            raise Rejected(f"{url}: HTTP {exc.code}: {text.strip()}") from exc
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ServerError(f"{url}: no answer ({reason or type(exc).__name__})") from exc
        if not payload:
            return None
        try:
            return json.loads(payload)
        except ValueError:
            return None

    def live(self) -> bool:
        try:
            self.request("/v2/health/live", timeout=5.0)
        except ServerError:
            return False
        return True


@dataclass(frozen=True)
class Endpoints:
    """A running Triton: its HTTP (repository API), gRPC (measured) and metrics addresses."""

    http: str  # HOST:PORT
    grpc: str  # HOST:PORT
    metrics: str | None = None  # http://HOST:PORT/metrics; None: the gRPC host's port 8002
    key: str | None = field(default=None, repr=False)  # sent as triton-admin-key on repository requests
