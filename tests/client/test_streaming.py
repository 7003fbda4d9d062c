"""Streaming gRPC for decoupled models (client.streaming, `--streaming`) against a real Triton: a python-backend
model that answers N responses per request (N from its input, 5 ms apart) through its response sender, so the
responses per request, the first response before the final one, and the error responses are properties of
what the server sent; and the refusals (a model that is not decoupled, a decoupled one without the flag, the
options streaming does not take)."""

from __future__ import annotations

import asyncio
import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from builder.serving.triton_server import TritonServer
from client.cli import main, parse_config
from client.errors import PerfClientError
from client.stats import Tally, close, merge
from client.streaming import Stream, StreamTiming
from tests.helpers.python_models import serving
from tests.helpers.waiting import wait_until_async

STREAM_MODEL = '''
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy().flat[0])
            if n < 0:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"N {n} is negative")),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            tail = n >= 100  # N = 100 + k: k responses, then 300 ms of work before the (empty) final one
            for i in range(n - 100 if tail else n):
                time.sleep(0.005)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i], np.int32))]))
            if tail:
                time.sleep(0.3)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''

STREAM_CONFIG = '''
name: "stream"
backend: "python"
max_batch_size: 0
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
model_transaction_policy { decoupled: true }
instance_group [ { count: 2 kind: KIND_CPU } ]
'''

PLAIN_MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.zeros(1, np.int32))]) for _ in requests]
'''

PLAIN_CONFIG = '''
name: "plain"
backend: "python"
max_batch_size: 0
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
'''

QUICK = ["--measurement-interval", "400", "--max-trials", "3", "--stability-percentage", "90", "--warmup", "2",
         "--no-progress", "--power-source", "none"]


@pytest.fixture(scope="module")
def stream_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    root = tmp_path_factory.mktemp("streaming")
    with serving(root, [("stream", STREAM_MODEL, STREAM_CONFIG), ("plain", PLAIN_MODEL, PLAIN_CONFIG)]) as server:
        yield server


def _inputs(tmp_path: Path, *counts: int) -> str:
    """An --input-data file whose samples ask for these numbers of responses (one payload each)."""
    path = tmp_path / "n.npz"
    np.savez(path, N=np.array([[n] for n in counts], np.int32))
    return str(path)


@pytest.mark.server
@pytest.mark.parametrize("client", ["native", "aio"])
def test_each_request_gets_its_n_responses_the_first_before_the_final(
        stream_server: TritonServer, client: str, tmp_path: Path) -> None:
    report, table = tmp_path / "run.json", tmp_path / "run.csv"
    code = main(["-m", "stream", "-u", f"127.0.0.1:{stream_server.ports.grpc}", "--streaming", "--grpc-client", client,
                 "--concurrency", "2", "--input-data", _inputs(tmp_path, 3), "--json", str(report), "--csv", str(table),
                 *QUICK])
    assert code == 0
    doc = json.loads(report.read_text())
    assert doc["streaming"] is True and doc.get("grpc_client", "native") == client
    (result,) = doc["results"]
    assert result["errors"] == {} and result["requests"] > 0
    stream = result["streaming"]
    assert stream["responses_per_request"] == 3.0
    # The first response comes ~5 ms after the send, the final one after the third (~15 ms).
    assert stream["first_response_us"]["p50"] < result["latency_us"]["p50"]
    assert stream["first_response_us"]["max"] <= result["latency_us"]["max"]
    assert stream["inter_response_us"]["p50"] >= 4000  # the model sleeps 5 ms between responses
    rows = list(csv.DictReader(table.open()))
    assert rows[0]["Responses/Request"] == "3.0" and int(rows[0]["p50 first response"]) > 0


@pytest.mark.server
def test_latency_ends_at_the_last_answer_and_a_request_without_one_is_no_success(
        stream_server: TritonServer, tmp_path: Path) -> None:
    """As perf_analyzer counts a decoupled request: its latency ends at the last response that carried an answer,
    not at the empty final response the model sends 300 ms later; a request answered by the empty final response
    alone is not a success (error kind no_response)."""
    report = tmp_path / "run.json"
    code = main(["-m", "stream", "-u", f"127.0.0.1:{stream_server.ports.grpc}", "--streaming", "--concurrency", "2",
                 "--input-data", _inputs(tmp_path, 102, 100), "--json", str(report), *QUICK])
    assert code == 0
    (result,) = json.loads(report.read_text())["results"]
    assert result["requests"] > 0 and set(result["errors"]) == {"no_response"}
    assert result["streaming"]["responses_per_request"] == 2.0
    # Two answers 5 ms apart: well under the 300 ms the final response waits (the old end: p50 over 300 ms).
    assert result["latency_us"]["p50"] < 150_000, result["latency_us"]


@pytest.mark.server
def test_an_error_response_counts_as_an_error_and_ends_only_its_request(
        stream_server: TritonServer, tmp_path: Path) -> None:
    report = tmp_path / "run.json"
    # Payloads alternate: 2 responses, then an error response (the probe sends the first).
    code = main(["-m", "stream", "-u", f"127.0.0.1:{stream_server.ports.grpc}", "--streaming", "--concurrency", "1",
                 "--input-data", _inputs(tmp_path, 2, -1), "--json", str(report), *QUICK])
    assert code == 0
    (result,) = json.loads(report.read_text())["results"]
    assert result["requests"] > 0 and set(result["errors"]) == {"response_error"}
    assert abs(result["errors"]["response_error"] - result["requests"]) <= 2  # in turn, one each
    assert result["streaming"]["responses_per_request"] == 2.0  # successful requests only


@pytest.mark.server
@pytest.mark.parametrize(("argv", "expected"), [
    (["-m", "plain", "--streaming"], "--streaming: -m plain is not a decoupled model"),
    (["-m", "stream"], "-m stream is a decoupled model (any number of responses per request): add --streaming"),
    (["-m", "stream", "--streaming", "--input-data", "NEGATIVE"],
     "-m stream: the server rejected the request: N -1 is negative"),
])
def test_streaming_against_the_wrong_model_is_refused_in_one_line(
        stream_server: TritonServer, argv: list[str], expected: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    argv = [_inputs(tmp_path, -1) if arg == "NEGATIVE" else arg for arg in argv]
    assert main([*argv, "-u", f"127.0.0.1:{stream_server.ports.grpc}", *QUICK]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


@pytest.mark.parametrize(("argv", "expected"), [
    (["-i", "http"], "--streaming: not with -i http"),
    (["--request-rate", "10"], "--streaming: not with 10 req/s (constant) (closed loop only: --concurrency)"),
    (["--processes", "2", "--concurrency", "2"], "--streaming: not with --processes 2"),
    (["--shared-memory", "system"], "--streaming: not with --shared-memory system"),
    (["--sequence-length", "4"], "--streaming: not with the sequence flags"),
])
def test_options_streaming_does_not_take_are_refused(argv: list[str], expected: str) -> None:
    with pytest.raises(PerfClientError) as caught:
        parse_config(["-m", "stream", "--streaming", *argv])
    assert expected in str(caught.value) and "\n" not in str(caught.value)


def test_stream_figures_merge_over_windows() -> None:
    windows = []
    for first, gaps, count in ((1000, [10, 30], 3), (3000, [20], 2)):
        tally = Tally()
        tally.ok(5000)
        tally.streamed(first, gaps, count)
        windows.append(close(tally, 0, 10, 1))
    none = Tally()
    none.ok(5000)
    none.streamed(None, [], 0)  # a request whose only response was the empty final one
    windows.append(close(none, 10, 20, 1))
    stream = merge(windows, 1).stream
    assert stream is not None and stream.responses_per_request == pytest.approx(5 / 3)
    assert stream.first_response_us is not None and stream.first_response_us.max == 3.0
    assert stream.inter_response_us is not None and stream.inter_response_us.p50 == 0.02
    assert merge([close(Tally(), 0, 1, 1)], 1).stream is None  # not streamed: no figures


def test_a_stream_the_server_ended_between_requests_is_opened_again() -> None:
    """A server that ends each ModelStreamInfer call after one request (draining, GOAWAY): the next request
    goes out on a new call instead of raising grpc.aio's InvalidStateError (no error kind of ours: a traceback)."""

    async def one_request_per_call(requests: Any, context: Any) -> Any:
        async for raw in requests:
            request = service_pb2.ModelInferRequest.FromString(raw)
            answer = service_pb2.ModelStreamInferResponse()
            answer.infer_response.id = request.id
            answer.infer_response.outputs.add(name="OUT")
            answer.infer_response.parameters["triton_final_response"].bool_param = True
            yield answer.SerializeToString()
            return  # the call ends here, as a draining server ends it

    async def scenario() -> list[StreamTiming]:
        server = grpc.aio.server()
        handler = grpc.stream_stream_rpc_method_handler(one_request_per_call)
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "inference.GRPCInferenceService", {"ModelStreamInfer": handler})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stream = Stream(channel, timeout_s=10)
        try:
            message = service_pb2.ModelInferRequest(model_name="stream").SerializeToString()
            timings = []
            for _ in range(3):
                timings.append(await stream.request(message))
                # The server's end of the call has arrived before the next request is written.
                await wait_until_async(lambda: stream._call is None or stream._call.done(), what="the call's end")
            return timings
        finally:
            await stream.aclose()
            await channel.close()
            await server.stop(None)

    timings = asyncio.run(scenario())
    assert [t.error for t in timings] == [None, None, None] and [t.responses for t in timings] == [1, 1, 1]
