"""gRPC and HTTP connections to Triton behind one small async interface."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from numpy.typing import NDArray

from client.errors import PerfClientError

log = logging.getLogger(__name__)

PROTOCOLS = ("grpc", "http")
DEFAULT_PORTS = {"grpc": 8001, "http": 8000}


@dataclass(frozen=True)
class TensorMeta:
    name: str
    datatype: str
    shape: tuple[int, ...]  # without the batch axis when the model batches


@dataclass(frozen=True)
class ModelMeta:
    name: str
    max_batch_size: int
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]


@dataclass(frozen=True)
class ServerStats:
    """Cumulative counters from Triton's statistics API (nanoseconds and counts)."""

    success_count: int = 0
    queue_ns: int = 0
    compute_input_ns: int = 0
    compute_infer_ns: int = 0
    compute_output_ns: int = 0
    inference_count: int = 0
    execution_count: int = 0


def _int(value: Any) -> int:
    return int(value) if value not in (None, "") else 0


def _part(stats: dict[str, Any], key: str) -> dict[str, Any]:
    value = stats.get(key, {})
    return value if isinstance(value, dict) else {}


def parse_statistics(payload: dict[str, Any], model: str) -> ServerStats:
    for entry in payload.get("model_stats", []):
        if entry.get("name") != model:
            continue
        stats = entry.get("inference_stats", {})
        return ServerStats(
            success_count=_int(_part(stats, "success").get("count")),
            queue_ns=_int(_part(stats, "queue").get("ns")),
            compute_input_ns=_int(_part(stats, "compute_input").get("ns")),
            compute_infer_ns=_int(_part(stats, "compute_infer").get("ns")),
            compute_output_ns=_int(_part(stats, "compute_output").get("ns")),
            inference_count=_int(entry.get("inference_count")),
            execution_count=_int(entry.get("execution_count")),
        )
    return ServerStats()


@dataclass(frozen=True)
class Prepared:
    """A request serialized once and sent many times: the load loop does no per-request encoding."""

    model: str
    body: bytes
    headers: dict[str, str]


class Connection:
    """One client connection; `prepare` serializes a request once, `send` sends it as it is.

    The request bytes are what tritonclient itself would send (its own request builders make
    them); responses are checked for errors but not decoded, as perf_analyzer does.
    """

    def __init__(self, protocol: str, url: str) -> None:
        if protocol not in PROTOCOLS:
            raise PerfClientError(f"-i {protocol!r}: expected one of {', '.join(PROTOCOLS)}")
        self.protocol = protocol
        self.url = url
        self._client: Any
        self._raw: Any = None
        if protocol == "grpc":
            import grpc
            import tritonclient.grpc.aio as grpc_aio

            self._client = grpc_aio.InferenceServerClient(url=url)
            self._channel = grpc.aio.insecure_channel(url, options=[
                ("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)])
            # No serializers: requests go out as the bytes given, responses come back as bytes.
            self._raw = self._channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        else:
            import tritonclient.http.aio as http_aio

            self._client = http_aio.InferenceServerClient(url=url, conn_limit=1024)

    async def close(self) -> None:
        await self._client.close()
        if self.protocol == "grpc":
            await self._channel.close()

    async def live(self) -> bool:
        try:
            return bool(await self._client.is_server_live())
        except Exception:  # noqa: BLE001 - any failure means "not live"
            return False

    async def model(self, name: str) -> ModelMeta:
        # Liveness, not server readiness: with explicit model control another model may be loading
        # or unloading, which makes the whole server "not ready" while this model serves.
        try:
            if not await self._client.is_server_live():
                raise PerfClientError(f"-u {self.url}: server is up but not live")
        except PerfClientError:
            raise
        except Exception as exc:
            raise PerfClientError(f"-u {self.url}: cannot reach Triton over {self.protocol} ({_short(exc)})") from exc
        try:
            if self.protocol == "grpc":
                meta = await self._client.get_model_metadata(name, as_json=True)
                config = (await self._client.get_model_config(name, as_json=True))["config"]
            else:
                meta = await self._client.get_model_metadata(name)
                config = await self._client.get_model_config(name)
        except Exception as exc:
            raise PerfClientError(f"-m {name}: model is not served at {self.url} ({_short(exc)})") from exc
        if not await self._client.is_model_ready(name):
            raise PerfClientError(f"-m {name}: model is not ready at {self.url}")
        max_batch = _int(config.get("max_batch_size"))

        def tensors(items: list[dict[str, Any]]) -> tuple[TensorMeta, ...]:
            out = []
            for item in items:
                shape = tuple(int(d) for d in item.get("shape", []))
                out.append(TensorMeta(item["name"], item["datatype"], shape[1:] if max_batch > 0 else shape))
            return tuple(out)

        return ModelMeta(name, max_batch, tensors(meta.get("inputs", [])), tensors(meta.get("outputs", [])))

    def prepare(self, arrays: dict[str, NDArray[Any]], datatypes: dict[str, str]) -> list[Any]:
        if self.protocol == "grpc":
            import tritonclient.grpc as grpcclient

            inputs = []
            for name, array in arrays.items():
                item = grpcclient.InferInput(name, list(array.shape), datatypes[name])
                item.set_data_from_numpy(array)
                inputs.append(item)
            return inputs
        import tritonclient.http as httpclient

        inputs = []
        for name, array in arrays.items():
            item = httpclient.InferInput(name, list(array.shape), datatypes[name])
            item.set_data_from_numpy(array, binary_data=True)
            inputs.append(item)
        return inputs

    async def infer(self, model: str, inputs: list[Any]) -> Any:
        """One request through tritonclient (decoded response): for probes and checks."""
        return await self._client.infer(model, inputs)

    def serialize(self, model: str, inputs: list[Any]) -> Prepared:
        if self.protocol == "grpc":
            from tritonclient.grpc._utils import _get_inference_request as grpc_request

            request = grpc_request(model, inputs, "", "", None, 0, False, False, 0, None, None)
            return Prepared(model, request.SerializeToString(), {})
        from tritonclient.http._utils import _get_inference_request as http_request

        body, json_size = http_request(inputs, "", None, 0, False, False, 0, None, None)
        headers = {"Inference-Header-Content-Length": str(json_size)} if json_size is not None else {}
        return Prepared(model, bytes(body), headers)

    async def send(self, prepared: Prepared) -> None:
        """Send a prepared request; raise on any error the server or the transport reports."""
        if self.protocol == "grpc":
            await self._raw(prepared.body)
            return
        session = self._client._stub  # tritonclient's aiohttp session, with its connection pool
        base = self._client._url
        async with session.post(f"{base}/v2/models/{prepared.model}/infer", data=prepared.body,
                                headers=prepared.headers) as response:
            payload = await response.read()
            if response.status != 200:
                raise PerfClientError(f"HTTP {response.status}: {payload[:200].decode('utf-8', 'replace')}")

    async def statistics(self, model: str) -> ServerStats:
        try:
            if self.protocol == "grpc":
                payload = await self._client.get_inference_statistics(model, as_json=True)
            else:
                payload = await self._client.get_inference_statistics(model)
        except Exception as exc:  # noqa: BLE001 - statistics are best effort mid-run
            log.debug("statistics unavailable: %s", exc)
            return ServerStats()
        return parse_statistics(payload, model)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def error_kind(exc: BaseException) -> str:
    """A short, stable label for counting errors by kind."""
    text = str(exc).lower()
    if "unavailable" in text or "connect" in text or "connection" in text or "refused" in text:
        return "unavailable"
    if "deadline" in text or "timeout" in text or "timed out" in text:
        return "timeout"
    if "unknown model" in text or "not found" in text:
        return "unknown_model"
    if "invalid" in text or "unexpected shape" in text or "expected" in text:
        return "invalid_argument"
    return type(exc).__name__
