"""perfclient --request-intervals: the open loop replays the file's gaps (repeated) on a real Triton, the
actual sends follow them within 5 %, latency counts from the scheduled time, and a bad file is one line
naming the file and the line."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from client.cli import main
from client.engine import LevelResult, LoadLevel, LoadRun, Measurement
from client.errors import PerfClientError
from client.inputs import InputData, build_payloads
from client.intervals import load_intervals
from client.power import NoMeter
from client.protocol import Connection, Protocol
from client.stats import Records
from tests.helpers.servers import Endpoints

MODEL = "mlp_fp32"
# Uneven on purpose (mean 50 ms, 20 req/s): a constant-rate loop at the mean would not follow it. Gaps of
# tens of ms: on this shared 2-core CPU a send's own jitter is a few ms.
PATTERN_US = [20000, 75000, 50000, 15000, 90000]


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def replay(url: str, level: LoadLevel) -> tuple[LevelResult, Records]:
    async def go() -> tuple[LevelResult, Records]:
        async with await Connection.open(Protocol.GRPC, url) as conn:
            meta = await conn.model(MODEL)
            payloads = [await conn.prepare(MODEL, arrays) for arrays in build_payloads(meta, 1, InputData(), {})]
            run = LoadRun(conn, model=MODEL, payloads=payloads, batch=1, meter=NoMeter("not measured here"),
                          measurement=Measurement(measurement_ms=2000, stability_percentage=100, max_trials=3,
                                                  warmup_requests=5), keep_records=True)
            result = await run.run(level)
            assert run.records is not None
            return result, run.records

    return asyncio.run(go())


def test_the_replay_follows_the_file_within_5_percent(endpoints: Endpoints, tmp_path: Path) -> None:
    replay_file = load_intervals(write(tmp_path / "intervals.txt", "\n".join(map(str, PATTERN_US)) + "\n"))
    assert replay_file.rate == pytest.approx(20.0)
    result, records = replay(endpoints.grpc, LoadLevel(request_rate=replay_file.rate, intervals=replay_file))
    order = np.argsort(records.scheduled)
    scheduled = np.asarray(records.scheduled, dtype=np.int64)[order]
    sent = np.asarray(records.sent, dtype=np.int64)[order]
    errors = [records.errors[i] for i in order]
    assert len(scheduled) > 3 * len(PATTERN_US) and errors.count(None) == len(errors), errors
    # The schedule is the file, repeated: its n-th gap is the file's n-th (mod its length), exactly.
    planned = np.diff(scheduled) / 1e3
    pattern = np.asarray(PATTERN_US, dtype=float)
    phase = int(np.argmin(np.abs(pattern - planned[0])))  # the first recorded send may not be the file's first
    want = pattern[(np.arange(len(planned)) + phase) % len(pattern)]
    np.testing.assert_allclose(planned, want, atol=0.01)  # 10 ns: float accumulation only
    # In the measured windows (not the warm-up, where the first connection is slow), the sends follow the
    # file within 5 % of its mean interval: per position in the file, the median actual gap (the median: a
    # stall on this shared CPU is followed by a catch-up burst, as an open loop must; a send's own jitter
    # here, under a load average above 10, is about 1 ms), and as many sends as the file schedules there.
    # A constant rate at the file's mean would miss the 15 ms gap by 35 ms.
    start, end = result.windows[0].start_ns, result.windows[-1].end_ns
    measured = (scheduled[1:] >= start) & (scheduled[1:] < end)
    actual = np.diff(sent) / 1e3
    position = (np.arange(len(actual)) + phase) % len(pattern)
    for k, gap in enumerate(PATTERN_US):
        gaps = actual[measured & (position == k)]
        assert len(gaps) >= 8 and np.median(gaps) == pytest.approx(gap, abs=0.05 * pattern.mean()), (gap, gaps)
    in_span = int(((sent >= start) & (sent < end)).sum())
    assert in_span == pytest.approx((end - start) / 1e3 / pattern.mean(), rel=0.05)
    lag_us = (sent - scheduled)[(scheduled >= start) & (scheduled < end)] / 1e3
    # Latency counts from the scheduled time: the summary's p50 is at least the sends' median lag.
    assert result.summary.latency_us is not None and result.summary.latency_us.p50 >= np.median(lag_us)


def test_the_cli_replays_at_the_files_rate(endpoints: Endpoints, tmp_path: Path, quick_args: list[str],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "intervals.txt", "\n".join(map(str, PATTERN_US)))
    out_json = tmp_path / "r.json"
    code = main(["-m", MODEL, "-u", endpoints.grpc, "--request-intervals", str(path), "--power-source", "none",
                 "--json", str(out_json), *quick_args, "--measurement-interval", "1000"])
    out = capsys.readouterr().out
    assert code == 0
    (result,) = json.loads(out_json.read_text())["results"]
    assert result["request_rate"] == pytest.approx(20.0) and result["errors"] == {}
    assert result["request_intervals"] == str(path) and "distribution" not in result
    assert result["throughput"] == pytest.approx(20.0, rel=0.3)  # 1 s windows of an uneven pattern
    assert "intervals intervals.txt" in out


@pytest.mark.parametrize(("text", "message"), [
    ("100\n200\nabc\n", "intervals.txt:3: 'abc' is not a whole number of microseconds"),
    ("100\n-5\n", "intervals.txt:2: '-5' is not a whole number"),
    ("100\n2.5\n", "intervals.txt:2: '2.5' is not a whole number"),
    ("", "intervals.txt: no intervals"),
    ("\n\n", "intervals.txt: no intervals"),
    ("0\n0\n", "intervals.txt: every interval is 0"),
])
def test_a_bad_file_is_one_line_naming_the_file_and_line(
    text: str, message: str, tmp_path: Path, dead_url: str, capsys: pytest.CaptureFixture[str],
) -> None:
    path = write(tmp_path / "intervals.txt", text)
    with pytest.raises(PerfClientError) as caught:
        load_intervals(path)
    assert message in str(caught.value) and str(caught.value).startswith(f"--request-intervals {tmp_path}")
    code = main(["-m", MODEL, "-u", dead_url, "--request-intervals", str(path)])
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert code == 1 and captured.out == "" and len(err) == 1 and message in err[0], err


def test_a_missing_file_and_a_second_load_flag_are_refused(tmp_path: Path, dead_url: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["-m", MODEL, "-u", dead_url, "--request-intervals", str(tmp_path / "absent.txt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "--request-intervals" in err[0] and "file not found" in err[0]
    path = write(tmp_path / "intervals.txt", "1000\n")
    with pytest.raises(SystemExit) as caught:  # argparse: the load flags exclude each other
        main(["-m", MODEL, "-u", dead_url, "--request-intervals", str(path), "--request-rate", "10"])
    assert caught.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
