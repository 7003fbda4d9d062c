"""Sequence (stateful) models: correlation ids, start/end flags and lengths, against a real Triton sequence batcher.

The served model (a python-backend counter behind Triton's sequence batcher) keeps a count per correlation id,
answers an error to a step of a sequence that was never started (or started twice), and writes one line per
step to a log the test reads: the property is read from what the server received, not from perfclient's
own account.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from builder.serving.triton_server import TritonServer
from client.cli import main
from client.errors import PerfClientError
from client.sequences import Flags, SequenceIds, SequenceOptions, Sequences, parse_id_range
from client.wire import (
    HTTP_HEADER_LENGTH,
    grpc_infer_request,
    grpc_sequence_parameters,
    http_infer_request,
    http_sequence_header,
)
from tests.helpers.python_models import serving

COUNTER_MODEL = '''
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.log = open(config["parameters"]["log"]["string_value"], "a", buffering=1)
        self.counts = {}

    def execute(self, requests):
        answers = []
        for request in requests:
            def control(name):
                return int(pb_utils.get_input_tensor_by_name(request, name).as_numpy().flat[0])

            if not control("READY"):  # the direct strategy's filler for a slot with no request this time
                answers.append(pb_utils.InferenceResponse([pb_utils.Tensor("count", np.zeros((1, 1), np.int64))]))
                continue
            start, end, corrid = control("START"), control("END"), control("CORRID")
            if start and corrid in self.counts:
                self.log.write(f"{corrid} restarted\\n")
                answers.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{corrid} started twice")))
                continue
            if start:
                self.counts[corrid] = 0
            if corrid not in self.counts:
                self.log.write(f"{corrid} unstarted\\n")
                answers.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{corrid} not started")))
                continue
            self.counts[corrid] += 1
            count = self.counts[corrid]
            if end:
                del self.counts[corrid]
            self.log.write(f"{corrid} {count} {start} {end}\\n")
            answers.append(pb_utils.InferenceResponse([pb_utils.Tensor("count", np.array([[count]], np.int64))]))
        return answers
'''

COUNTER_CONFIG = '''
name: "counter"
backend: "python"
max_batch_size: 8
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "count" data_type: TYPE_INT64 dims: [ 1 ] }} ]
sequence_batching {{
  max_sequence_idle_microseconds: 20000000
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "END" control [ {{ kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "READY" control [ {{ kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 }} ] }}
  ]
}}
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
parameters {{ key: "log" value: {{ string_value: "{log}" }} }}
'''

PLAIN_MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("count", np.zeros((1, 1), np.int64))]) for _ in requests]
'''

PLAIN_CONFIG = '''
name: "plain"
backend: "python"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "count" data_type: TYPE_INT64 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
'''

QUICK = ["--measurement-interval", "300", "--max-trials", "3", "--stability-percentage", "90", "--warmup", "0",
         "--no-progress", "--power-source", "none"]


@pytest.fixture(scope="module")
def sequence_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TritonServer, Path]]:
    root = tmp_path_factory.mktemp("sequences")
    log = root / "counter.log"
    with serving(root, [("counter", COUNTER_MODEL, COUNTER_CONFIG.format(log=log)),
                        ("plain", PLAIN_MODEL, PLAIN_CONFIG)]) as server:
        yield server, log


def _url(server: TritonServer, protocol: str) -> str:
    return f"127.0.0.1:{server.ports.grpc if protocol == 'grpc' else server.ports.http}"


def _steps(log: Path, offset: int) -> list[tuple[int, str]]:
    """(correlation id, the rest of its line) for each step logged after byte `offset`."""
    lines = log.read_bytes()[offset:].decode().splitlines()
    return [(int(line.split()[0]), line.split(None, 1)[1]) for line in lines]


def _sequences(steps: list[tuple[int, str]]) -> tuple[list[tuple[int, int]], int]:
    """Each completed sequence's (id, length) as the server saw it, in order, and the most live at once.
    Fails on any step the server refused, and on a step whose count is not the previous one's plus one."""
    live: dict[int, int] = {}
    done: list[tuple[int, int]] = []
    most = 0
    for corrid, rest in steps:
        assert rest not in ("restarted", "unstarted"), f"sequence {corrid}: {rest}"
        count, start, end = (int(x) for x in rest.split())
        assert (start == 1) == (corrid not in live), f"sequence {corrid}: start flag {start} at step {count}"
        assert count == live.get(corrid, 0) + 1, f"sequence {corrid}: step {count} after {live.get(corrid)}"
        live[corrid] = count
        most = max(most, len(live))
        if end:
            done.append((corrid, live.pop(corrid)))
    assert not live, f"sequences never ended: {live}"
    return done, most


@pytest.mark.server
@pytest.mark.parametrize(("protocol", "compression"), [("grpc", None), ("http", None), ("grpc", "gzip"),
                                                       ("http", "deflate")])
def test_closed_loop_sequences_arrive_in_order_with_their_flags_and_ids_in_range(
        sequence_server: tuple[TritonServer, Path], protocol: str, compression: str | None, tmp_path: Path) -> None:
    # Compressed: each step's flags are merged into the decompressed payload and compressed again (off the loop).
    server, log = sequence_server
    offset = log.stat().st_size if log.exists() else 0
    report = tmp_path / "run.json"
    compress = [] if compression is None else [f"--{protocol}-compression-algorithm", compression]
    code = main(["-m", "counter", "-u", _url(server, protocol), "-i", protocol, "--concurrency", "3",
                 "--sequence-length", "5", "--sequence-length-variation", "40", "--sequence-id-range", "100:104",
                 "--seed", "7", "--json", str(report), *compress, *QUICK])
    assert code == 0
    sequences, most = _sequences(_steps(log, offset))
    ids = {corrid for corrid, _ in sequences}
    assert ids <= set(range(100, 104)) and 100 in ids  # the probe's one-step sequence took the first id
    assert most <= 3  # one live sequence per concurrency slot (the probe ended before the load began)
    lengths = [length for _, length in sequences[1:]]  # after the probe
    assert max(lengths) <= 7  # 5 ± 40 %
    # Every sequence but those the level's end cut short (at most one per slot) has a drawn length.
    assert sum(length < 3 for length in lengths) <= 3
    assert len({length for length in lengths if length >= 3}) >= 2  # the lengths vary
    result = json.loads(report.read_text())["results"][0]
    assert result["errors"] == {} and result["requests"] > 0
    assert json.loads(report.read_text())["sequence"]["id_range"] == [100, 104]


@pytest.mark.server
def test_open_loop_sequences_take_the_sends_in_turn_one_step_at_a_time(
        sequence_server: tuple[TritonServer, Path], tmp_path: Path) -> None:
    server, log = sequence_server
    offset = log.stat().st_size if log.exists() else 0
    report = tmp_path / "run.json"
    code = main(["-m", "counter", "-u", _url(server, "grpc"), "--request-rate", "200", "--num-of-sequences", "2",
                 "--sequence-length", "4", "--sequence-length-variation", "0", "--sequence-id-range", "1:3",
                 "--json", str(report), *QUICK])
    assert code == 0
    sequences, most = _sequences(_steps(log, offset))
    assert {corrid for corrid, _ in sequences} == {1, 2}
    assert most <= 2
    assert sum(length != 4 for _, length in sequences[1:]) <= 2  # only the two the level's end cut short
    assert json.loads(report.read_text())["results"][0]["errors"] == {}


@pytest.mark.server
@pytest.mark.parametrize(("argv", "expected"), [
    (["-m", "plain", "--sequence-length", "5"], "-m plain is not a sequence model"),
    (["-m", "counter", "--processes", "2", "--concurrency", "2"], "--processes 2: -m counter is a sequence model"),
    (["-m", "counter", "--concurrency", "5", "--sequence-id-range", "1:4"],
     "--sequence-id-range 1:4: 3 ids for 5 live sequences"),
    (["-m", "counter", "--num-of-sequences", "2"], "--num-of-sequences 2: only with --request-rate"),
])
def test_sequence_flags_that_do_not_fit_are_refused_in_one_line(
        sequence_server: tuple[TritonServer, Path], argv: list[str], expected: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    server, _ = sequence_server
    assert main([*argv, "-u", _url(server, "grpc"), *QUICK]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


# --- without a server ------------------------------------------------------------------------------------


def test_ids_wrap_within_the_range_and_skip_those_still_live() -> None:
    ids = SequenceIds(SequenceOptions(id_start=10, id_end=13))
    assert [ids.take(), ids.take(), ids.take()] == [10, 11, 12]
    ids.give_back(11)
    assert ids.take() == 11  # 10 and 12 are still live
    ids.give_back(12)
    ids.give_back(10)
    assert ids.take() == 12  # in turn after 11, not the lowest free
    full = SequenceIds(SequenceOptions(id_start=1, id_end=2))
    full.take()
    with pytest.raises(PerfClientError, match="all 1 ids are held"):
        full.take()
    unbounded = SequenceIds(SequenceOptions(id_start=2**40))
    assert [unbounded.take() for _ in range(3)] == [2**40, 2**40 + 1, 2**40 + 2]


def test_lengths_are_drawn_within_the_variation_and_replay_with_the_seed() -> None:
    options = SequenceOptions(length=10, variation_pct=30)
    first = Sequences(options, np.random.SeedSequence(5))
    second = Sequences(options, np.random.SeedSequence(5))
    other = Sequences(options, np.random.SeedSequence(6))
    a = [first.draw_length() for _ in range(200)]
    assert a == [second.draw_length() for _ in range(200)]
    assert a != [other.draw_length() for _ in range(200)]
    assert min(a) >= 7 and max(a) <= 13 and len(set(a)) > 3
    assert Sequences(SequenceOptions(length=1, variation_pct=100), 0).length_bounds() == (1, 2)


def test_a_slot_runs_one_sequence_after_another() -> None:
    sequences = Sequences(SequenceOptions(length=2, variation_pct=0, id_start=5, id_end=7), 0)
    slot = sequences.slots(1)[0]
    flags = []
    for _ in range(4):
        flags.append(slot.next())
        slot.done()
    assert flags == [Flags(5, True, False), Flags(5, False, True), Flags(6, True, False), Flags(6, False, True)]
    slot.next()
    assert slot.closing() == Flags(5, False, True)
    slot.done()
    assert not slot.live and sequences.ids.live == frozenset()


def test_a_failed_step_abandons_its_sequence_and_a_failed_middle_step_retires_its_id() -> None:
    """A failed start: the server never started the sequence, so the next step starts a new one and the id may
    come again. A failed later step: the server may still hold the sequence, so its id is not handed out again
    this level (the remaining steps would only fail one after another, without start flags)."""
    sequences = Sequences(SequenceOptions(length=3, variation_pct=0, id_start=5, id_end=8), seed=0)
    (slot,) = sequences.slots(1)
    assert slot.next() == Flags(5, True, False)
    slot.finish(answered=False)  # the start failed: 5 goes back
    assert slot.next() == Flags(6, True, False)
    slot.finish(answered=True)
    assert slot.next() == Flags(6, False, False)
    slot.finish(answered=False)  # a middle step failed: 6 is retired, a fresh sequence starts
    assert slot.next() == Flags(7, True, False) and sequences.ids.retired == 1
    slot.finish(answered=False)
    assert slot.next() == Flags(5, True, False)  # 7 went back (its start failed); 6 is skipped
    slot.finish(answered=True)
    assert slot.next() == Flags(5, False, False)
    slot.finish(answered=False)  # 5 retired too: with 6, two of three ids abandoned
    assert slot.next() == Flags(7, True, False)
    slot.finish(answered=False)
    sequences.ids.take()  # 7, held by a live sequence elsewhere
    with pytest.raises(PerfClientError, match="2 abandoned after a failed step"):
        sequences.ids.take()


@pytest.mark.parametrize(("text", "expected"), [("7", (7, None)), ("1:9", (1, 9))])
def test_id_range_parses(text: str, expected: tuple[int, int | None]) -> None:
    assert parse_id_range(text) == expected


@pytest.mark.parametrize("text", ["", "a", "1:2:3", "-1", "5:5"])
def test_bad_id_ranges_are_refused(text: str) -> None:
    with pytest.raises(PerfClientError, match="--sequence-id-range"):
        start, end = parse_id_range(text)
        SequenceOptions(id_start=start, id_end=end)


def test_sequence_parameters_merge_into_a_serialized_grpc_request() -> None:
    from tritonclient.grpc import service_pb2

    body = grpc_infer_request("counter", {"x": np.ones((1, 1), np.float32)})
    request = service_pb2.ModelInferRequest()
    request.ParseFromString(body + grpc_sequence_parameters(2**62, start=True, end=False))
    params: Any = request.parameters
    assert params["sequence_id"].int64_param == 2**62
    assert params["sequence_start"].bool_param is True and params["sequence_end"].bool_param is False
    assert request.raw_input_contents[0] == np.ones((1, 1), np.float32).tobytes()


def test_sequence_parameters_join_the_http_header() -> None:
    body, headers = http_infer_request({"x": np.ones((1, 1), np.float32)})
    split = int(headers[HTTP_HEADER_LENGTH])
    header = json.loads(http_sequence_header(body[:split], 9, start=False, end=True))
    assert header["parameters"] == {"binary_data_output": True, "sequence_id": 9, "sequence_start": False,
                                    "sequence_end": True}


def test_more_live_sequences_than_ids_is_refused() -> None:
    with pytest.raises(PerfClientError, match="2 ids for 3 live sequences"):
        SequenceOptions(id_start=1, id_end=3).check_live(3, "concurrency 3")
    SequenceOptions(id_start=1, id_end=3).check_live(2, "concurrency 2")
    SequenceOptions().check_live(10**6, "concurrency 1000000")


def test_the_defaults_are_perf_analyzers() -> None:
    assert (SequenceOptions().length, SequenceOptions().variation_pct, SequenceOptions().num_sequences,
            SequenceOptions().id_start, SequenceOptions().id_end) == (20, 20.0, 4, 1, None)


def test_steps_bookkeeping_catches_a_sequence_out_of_order(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.write_text("1 1 1 0\n1 3 0 1\n")
    with pytest.raises(AssertionError, match="step 3 after 1"):
        _sequences(_steps(log, 0))
    log.write_text("1 1 1 0\n2 1 1 1\n")
    with pytest.raises(AssertionError, match="never ended"):
        _sequences(_steps(log, 0))
