"""`trtbuild verify`'s compact table: one row per variant, one column per protocol."""

from __future__ import annotations

from builder.serving.verify import VariantCheck, VerifyResult, table_lines
from client.protocol import Protocol


def _check(name: str, grpc: tuple[float, bool], http: tuple[float, bool], source: str = "held-out") -> VariantCheck:
    results = (VerifyResult(name, Protocol.GRPC, 16, *grpc, source=source),
               VerifyResult(name, Protocol.HTTP, 16, *http, source=source))
    return VariantCheck(name, results, {}, {})


def test_one_row_per_variant_with_each_protocols_verdict() -> None:
    lines = table_lines([_check("mlp_fp32", (0.0, True), (0.0, True)),
                         _check("mlp_int8", (0.0, True), (0.25, False), source="synthetic (opt shape)")])
    assert len(lines) == 4  # title, header, two variants
    assert lines[1].split()[:4] == ["variant", "samples", "grpc", "http"]
    assert lines[2].split() == ["mlp_fp32", "16", "held-out", "OK", "0.0e+00", "OK", "0.0e+00"]
    assert lines[3].split() == ["mlp_int8", "16", "synthetic", "(opt", "shape)", "OK", "0.0e+00", "MISMATCH",
                                "2.5e-01"]
    # Columns line up: each verdict starts where its header does.
    assert lines[3].index("MISMATCH") == lines[1].index("http") == lines[2].rindex("OK")
