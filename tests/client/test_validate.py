"""perfclient --validate against a real Triton: the file `trtbuild verify --save` writes drives the load and
every answer is checked; a differing answer is counted as a "mismatch" error, a bad file is one line."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from builder.serving.verify import check_models, expected_archive, npz_bytes
from builder.spec import ModelSpec
from client.cli import main
from client.protocol import Connection, Protocol, error_kind
from client.validate import MISMATCH, outputs_match
from client.wire import ResponseFormatError, grpc_infer_outputs, http_infer_outputs
from tests.helpers.servers import Endpoints

MODELS = ("mlp_fp32", "mlp_int8", "seq_fp32")


@pytest.fixture(scope="module")
def saved(tiny_repository: tuple[Path, list[ModelSpec]], endpoints: Endpoints,
          tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What `trtbuild verify --save` writes for the tiny models (mlp: 8 samples; seq: 8 of length 12)."""
    repository, specs = tiny_repository
    urls = {Protocol.GRPC: endpoints.grpc}
    checks = [c for c in check_models(specs, repository, urls, samples=8) if c.variant in MODELS]
    path = tmp_path_factory.mktemp("validate") / "expected.npz"
    path.write_bytes(npz_bytes(expected_archive(checks)))
    return path


def altered(source: Path, target: Path, change: dict[str, NDArray[Any] | None]) -> Path:
    """A copy of `source` with some arrays replaced (None: removed)."""
    with np.load(source) as archive:
        arrays = {k: archive[k] for k in archive.files}
    for key, value in change.items():
        if value is None:
            del arrays[key]
        else:
            arrays[key] = value
    target.write_bytes(npz_bytes(arrays))
    return target


def requests_served(endpoints: Endpoints, model: str) -> int:
    import tritonclient.http as http_tc

    client = http_tc.InferenceServerClient(url=endpoints.http)
    try:
        stats = client.get_inference_statistics(model)["model_stats"][0]["inference_stats"]
    finally:
        client.close()
    return int(stats["success"]["count"]) + int(stats["fail"]["count"])


def perfclient(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, list[str]]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip().splitlines()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_answers_that_match_the_saved_outputs_give_no_errors(
    protocol: str, saved: Path, endpoints: Endpoints, quick_args: list[str], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out_json = tmp_path / "r.json"
    code, out, _ = perfclient(["-m", "mlp_fp32", "-m", "mlp_int8", "-m", "seq_fp32", "-u", endpoints.url(protocol),
                               "-i", protocol, "-b", "2", "--concurrency", "2", "--validate", str(saved),
                               "--power-source", "none", "--json", str(out_json), *quick_args], capsys)
    assert code == 0
    docs = json.loads(out_json.read_text())["runs"]
    assert [d["model"] for d in docs] == list(MODELS)
    for doc in docs:
        (result,) = doc["results"]
        assert doc["validate"] == str(saved)
        assert result["errors"] == {} and result["requests"] > 0, doc
    assert all(line.split()[-1] == "0" for line in out.splitlines() if line.startswith(MODELS))


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_every_answer_differing_from_an_altered_file_counts_as_a_mismatch(
    protocol: str, saved: Path, endpoints: Endpoints, quick_args: list[str], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with np.load(saved) as archive:
        logits = archive["mlp_fp32/output/logits"]
    wrong = logits.copy()
    wrong[:, 0] += 0.5  # one class's logit off by far more than the tolerance, in every sample
    changed = altered(saved, tmp_path / "wrong.npz", {"mlp_fp32/output/logits": wrong})
    out_json = tmp_path / "r.json"
    code, out, _ = perfclient(["-m", "mlp_fp32", "-m", "seq_fp32", "-u", endpoints.url(protocol), "-i", protocol,
                               "-b", "4", "--validate", str(changed), "--power-source", "none",
                               "--json", str(out_json), *quick_args], capsys)
    assert code == 0  # errors are measured and shown, as for any other error kind; the run completes
    mlp, seq = json.loads(out_json.read_text())["runs"]
    (bad,), (good,) = mlp["results"], seq["results"]
    assert set(bad["errors"]) == {MISMATCH} and bad["errors"][MISMATCH] > 0
    assert bad["requests"] == 0 and bad["throughput"] == 0  # no answer counted as a success
    assert good["errors"] == {} and good["requests"] > 0  # the other model, same file, unaffected
    (row,) = [line for line in out.splitlines() if line.startswith("mlp_fp32")]
    assert int(row.split()[-1]) == bad["errors"][MISMATCH]  # the table's errors column


@pytest.mark.parametrize(("change", "message"), [
    ({"mlp_fp32/output/logits": None}, "no mlp_fp32/input/* and mlp_fp32/output/* arrays"),
    ({"mlp_fp32/input/x": None, "mlp_fp32/output/logits": None}, "(it holds models: mlp_int8, seq_fp32)"),
    ({"mlp_fp32/output/logits": np.zeros((8, 15), np.float32)}, "output 'logits' is [8, 15], expected 8 samples"),
    ({"mlp_fp32/output/logits": np.zeros((8, 16), np.float64)}, "output 'logits' is float64, model returns FP32"),
    ({"mlp_fp32/output/probs": np.zeros((8, 16), np.float32)}, "holds outputs ['logits', 'probs']"),
    ({"mlp_fp32/input/x": np.zeros((8, 4, 31), np.float32)}, "'x' samples are [4, 31], model expects [4, 32]"),
    ({"mlp_fp32/input/x": np.zeros((8, 4, 32), np.int32)}, "'x' is int32, model expects FP32"),
    ({"mlp_fp32/input/x": np.zeros((1, 4, 32), np.float32)}, "'x' has 1 samples, fewer than -b 2"),
])
def test_a_file_that_does_not_fit_the_model_is_one_line_before_any_load(
    change: dict[str, NDArray[Any] | None], message: str, saved: Path, endpoints: Endpoints,
    quick_args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    bad = altered(saved, tmp_path / "bad.npz", change)
    before = requests_served(endpoints, "mlp_fp32")
    code, out, err = perfclient(["-m", "mlp_fp32", "-u", endpoints.grpc, "-b", "2", "--validate", str(bad),
                                 "--power-source", "none", *quick_args], capsys)
    assert code == 1 and out == ""
    assert requests_served(endpoints, "mlp_fp32") == before  # not one request sent
    # Only perfclient's own lines: grpc.aio's poller can log "Event loop is closed" for an event loop an
    # earlier in-process run closed (pytest runs many CLIs in one process; a real one runs one loop).
    err = [line for line in err if line.startswith("perfclient")]
    assert len(err) == 1 and err[0].startswith(f"perfclient: error: --validate {bad}: "), err
    assert message in err[0]


def test_unusable_validate_arguments_are_one_line(
    saved: Path, endpoints: Endpoints, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    garbled = tmp_path / "garbled.npz"
    garbled.write_bytes(b"not a zip archive")
    shutil.copy(saved, tmp_path / "expected.bin")
    cases = [
        ([str(tmp_path / "absent.npz")], "file not found"),
        ([str(garbled)], "not a readable .npz"),
        ([str(tmp_path / "expected.bin")], "expected a .npz file"),
        ([str(saved), "--shape", "x:4,32"], "the inputs come from the file"),
    ]
    for args, message in cases:
        code, out, err = perfclient(["-m", "mlp_fp32", "-u", endpoints.grpc, "--validate", *args], capsys)
        assert code == 1 and out == "" and len(err) == 1, (args, err)
        assert err[0].startswith("perfclient: error: --validate ") and message in err[0], err


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_decoded_answers_equal_what_tritonclient_decodes(protocol: str, saved: Path, endpoints: Endpoints) -> None:
    import tritonclient.grpc as grpc_tc
    import tritonclient.http as http_tc

    with np.load(saved) as archive:
        ids = archive["seq_fp32/input/ids"][:3]
        want = archive["seq_fp32/output/out"][:3]

    async def infer() -> dict[str, NDArray[Any]]:
        async with await Connection.open(Protocol(protocol), endpoints.url(protocol)) as conn:
            return await conn.infer(await conn.prepare("seq_fp32", {"ids": ids}))

    got = asyncio.run(infer())
    tc: Any = grpc_tc if protocol == "grpc" else http_tc
    client = tc.InferenceServerClient(url=endpoints.url(protocol))
    try:
        item = tc.InferInput("ids", list(ids.shape), "INT64")
        item.set_data_from_numpy(ids)
        reference = client.infer("seq_fp32", [item]).as_numpy("out")
    finally:
        client.close()
    assert set(got) == {"out"} and got["out"].dtype == np.float32
    assert np.array_equal(got["out"], reference)
    assert outputs_match(got, {"out": want}) and not outputs_match(got, {"out": want + 1e-2})
    assert not outputs_match(got, {"out": want[:2]}) and not outputs_match({}, {"out": want})


def test_garbled_answers_raise_a_format_error_counted_as_bad_response() -> None:
    header = json.dumps({"outputs": [{"name": "y", "datatype": "FP32", "shape": [2, 2],
                                      "parameters": {"binary_data_size": 16}}]}).encode()
    body = header + np.arange(4, dtype=np.float32).tobytes()
    assert np.array_equal(http_infer_outputs(body, str(len(header)))["y"], np.arange(4, dtype=np.float32).reshape(2, 2))
    as_json = json.dumps({"outputs": [{"name": "y", "datatype": "INT64", "shape": [2], "data": [3, 4]}]}).encode()
    assert http_infer_outputs(as_json, None)["y"].tolist() == [3, 4]
    for bad in (lambda: http_infer_outputs(body[:-4], str(len(header))),  # truncated binary data
                lambda: http_infer_outputs(b"<html>", None),
                lambda: grpc_infer_outputs(b"\xff\xff\xff")):
        with pytest.raises(ResponseFormatError) as caught:
            bad()
        assert error_kind(caught.value) == "bad_response"

