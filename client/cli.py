"""`perfclient`: load a Triton model and report latency, throughput, watts and joules per inference."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from client import cli_env  # noqa: F401  (first: the command's process-wide settings, before grpc is imported)
from client.admin_key import KEY_ENV, request_headers
from client.compression import ALGORITHMS
from client.engine import DEFAULT_MAX_INFLIGHT, Distribution, LoadLevel, Measurement
from client.errors import PerfClientError, UsageConflict
from client.grpc_aio import GrpcClient
from client.html_report import write_html
from client.inputs import InputData, parse_shapes
from client.intervals import load_intervals
from client.plot import plot
from client.power import PowerSource, parse_gpus
from client.protocol import REQUEST_TIMEOUT_S, Protocol
from client.report import documents, table, write_csv, write_json
from client.sequences import (
    DEFAULT_LENGTH,
    DEFAULT_NUM_SEQUENCES,
    DEFAULT_VARIATION_PCT,
    SequenceOptions,
    parse_id_range,
)
from client.session import WHOLE_RUN, ModelResult, RunAborted, SessionConfig, run
from client.shared_memory import DEFAULT_OUTPUT_SIZE, SharedMemory, SharedMemoryKind
from client.tls import Tls
from client.validate import ATOL as VALIDATE_ATOL
from client.validate import RTOL as VALIDATE_RTOL
from client.validate import ValidateOptions
from common import progress
from common.logs import configure_logging


@dataclass(frozen=True)
class CliConfig:
    """One invocation: the session, where its outputs go, and how much the terminal shows."""

    session: SessionConfig
    json_path: Path | None = None
    csv_path: Path | None = None
    plot_path: Path | None = None
    html_path: Path | None = None
    progress: bool = True
    verbose: int = 0  # -v: our DEBUG lines; -vv: third-party libraries' too
    quiet: bool = False  # warnings and errors only


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="perfclient", description=__doc__)
    p.add_argument("-m", "--model", action="append", required=True,
                   help="model name (repeat to compare several models under the same load)")
    p.add_argument("-u", "--url", default=None, help="HOST:PORT (default localhost:8001 for grpc, :8000 for http)")
    p.add_argument("-i", "--protocol", default="grpc", help=" | ".join(Protocol.values()))
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, help="closed loop: N requests in flight")
    load.add_argument("--concurrency-range", help="closed-loop sweep START:END[:STEP]")
    load.add_argument("--request-rate", type=float, help="open loop: requests per second")
    load.add_argument("--request-intervals", type=Path, metavar="FILE",
                      help="open loop: replay FILE's gaps (microseconds, one per line), repeated")
    p.add_argument("--distribution", default="constant",
                   help=f"open-loop arrivals: {' | '.join(Distribution.values())}")
    p.add_argument("--max-inflight", type=int, default=DEFAULT_MAX_INFLIGHT,
                   help="open loop: at most N requests in flight; a send due beyond that is dropped and counted "
                        f"(default {DEFAULT_MAX_INFLIGHT})")
    p.add_argument("--request-timeout-ms", type=int, default=int(REQUEST_TIMEOUT_S * 1000),
                   help="deadline of every inference request; a later answer counts as error kind timeout "
                        f"(default {int(REQUEST_TIMEOUT_S * 1000)})")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="stop the whole run after this long, keeping the windows measured (exit 1, like Ctrl-C)")
    p.add_argument("--processes", type=int, default=1, metavar="N",
                   help="generate the load from N worker processes (their records merge exactly; default 1)")
    p.add_argument("--gpus", default=None, metavar="LIST",
                   help="meter these GPUs (indices or UUIDs: 0,3); default: those the models' instance groups "
                        "name, else CUDA_VISIBLE_DEVICES, else every GPU")
    p.add_argument("--seed", type=int, default=None, metavar="N",
                   help="seed of the Poisson arrivals (one stream per model, level and process) and the random "
                        "inputs (default: drawn at random, recorded in --json)")
    p.add_argument("--simultaneous", action="store_true",
                   help="load every -m model at once (default: one after another); energy for the whole run")
    p.add_argument("--model-concurrency", action="append", default=[], metavar="MODEL=N",
                   help="this model's own concurrency instead of the shared load (repeatable)")
    p.add_argument("--model-request-rate", action="append", default=[], metavar="MODEL=R",
                   help="this model's own request rate instead of the shared load (repeatable)")
    p.add_argument("-b", "--batch-size", type=int, default=1)
    p.add_argument("--input-data", default=None, help="random | zero | FILE.npz | DIR of NAME.npy (default: random)")
    p.add_argument("--validate", type=Path, default=None, metavar="FILE.npz",
                   help="send the samples of `trtbuild verify --save FILE.npz` (with --input-data: among those "
                        "payloads) and check answers against its expected outputs (mismatches count as errors)")
    p.add_argument("--validate-atol", type=float, default=VALIDATE_ATOL, metavar="A",
                   help=f"--validate: absolute tolerance (default {VALIDATE_ATOL:g})")
    p.add_argument("--validate-rtol", type=float, default=VALIDATE_RTOL, metavar="R",
                   help=f"--validate: relative tolerance (default {VALIDATE_RTOL:g})")
    p.add_argument("--validate-fraction", type=float, default=1.0, metavar="F",
                   help="--validate: compare this share of the file's answers, 0 < F <= 1 (default 1: all)")
    p.add_argument("--shared-memory", default="none",
                   help=f"{' | '.join(SharedMemoryKind.values())}: send tensors through shared memory regions "
                        "registered with a local server (cuda needs cuda-python and a GPU)")
    p.add_argument("-H", "--header", action="append", default=[], metavar="NAME:VALUE",
                   help="a header for the server's control requests (shared-memory registration), perf_analyzer's "
                        f"form; ${KEY_ENV} adds the admin key of a server whose restricted APIs need it (keeps the "
                        "key off the command line, which every local user can read)")
    p.add_argument("--output-shared-memory-size", type=int, default=DEFAULT_OUTPUT_SIZE, metavar="BYTES",
                   help="bytes of each output's region with --shared-memory (0: outputs come in the answer)")
    p.add_argument("--shape", action="append", default=[], help="NAME:D1,D2 for dynamic dims (no batch dim)")
    p.add_argument("--measurement-interval", type=int, default=5000, help="window length in ms")
    p.add_argument("--request-count", type=int, default=0, help="close each window after N requests instead")
    p.add_argument("--stability-percentage", type=float, default=10.0)
    p.add_argument("--max-trials", type=int, default=10, help="at most N windows per load level")
    p.add_argument("--warmup", type=int, default=20, help="requests completed before measuring")
    p.add_argument("--power-source", default="auto", help=" | ".join(PowerSource.values()))
    p.add_argument("--metrics-url", default=None, help="Triton metrics (default http://HOST:8002/metrics)")
    p.add_argument("--json", type=Path)
    p.add_argument("--csv", type=Path)
    p.add_argument("--plot", type=Path, help="PNG: latency vs throughput, power over time")
    p.add_argument("--html", type=Path, metavar="PATH",
                   help="one self-contained HTML report: tables, plots, settings, tool versions")
    p.add_argument("--no-progress", action="store_true", help="no progress display")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="-v: our debug messages; -vv: third-party libraries' too")
    p.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only, no progress")
    _add_transport_flags(p)
    _add_sequence_flags(p)
    return p


def _add_sequence_flags(p: argparse.ArgumentParser) -> None:
    """perf_analyzer's sequence-model flags (a model whose config has sequence_batching)."""
    seq = p.add_argument_group("sequence models (perf_analyzer's flags; a sequence model without them gets their "
                               "defaults)")
    seq.add_argument("--sequence-length", type=int, default=None, metavar="N",
                     help=f"requests per sequence, around N (default {DEFAULT_LENGTH})")
    seq.add_argument("--sequence-length-variation", type=float, default=None, metavar="PCT",
                     help="each sequence's length is drawn uniformly within ±PCT %% of --sequence-length, from "
                          f"--seed (default {DEFAULT_VARIATION_PCT:g})")
    seq.add_argument("--sequence-id-range", default=None, metavar="START[:END]",
                     help="correlation ids from START up to END (excluded; default 1, no end), reused once their "
                          "sequence ended")
    seq.add_argument("--num-of-sequences", type=int, default=None, metavar="N",
                     help=f"open loop: N sequences live at once, taking the sends in turn (default "
                          f"{DEFAULT_NUM_SEQUENCES}; closed loop: one per concurrency slot)")


def _sequence(args: argparse.Namespace) -> SequenceOptions | None:
    """The sequence flags given; None without any."""
    given = (args.sequence_length, args.sequence_length_variation, args.sequence_id_range, args.num_of_sequences)
    if all(value is None for value in given):
        return None
    open_loop = args.request_rate is not None or args.request_intervals is not None or args.model_request_rate
    if args.num_of_sequences is not None and not open_loop:
        raise PerfClientError(f"--num-of-sequences {args.num_of_sequences}: only with --request-rate or "
                              "--request-intervals (closed loop: one sequence per concurrency slot)")
    start, end = parse_id_range(args.sequence_id_range) if args.sequence_id_range is not None else (1, None)
    return SequenceOptions(
        length=args.sequence_length if args.sequence_length is not None else DEFAULT_LENGTH,
        variation_pct=(args.sequence_length_variation if args.sequence_length_variation is not None
                       else DEFAULT_VARIATION_PCT),
        id_start=start, id_end=end,
        num_sequences=args.num_of_sequences if args.num_of_sequences is not None else DEFAULT_NUM_SEQUENCES)


# perf_analyzer's TLS flags (those it has); --ssl-server-name is ours (SNI and the name checked).
_GRPC_TLS = ("--ssl-grpc-root-certifications-file", "--ssl-grpc-certificate-chain-file", "--ssl-grpc-private-key-file")
_HTTPS_TLS = ("--ssl-https-ca-certificates-file", "--ssl-https-client-certificate-file",
              "--ssl-https-private-key-file")


def _add_transport_flags(p: argparse.ArgumentParser) -> None:
    """The gRPC client, streaming, TLS and compression, perf_analyzer's names where it has them."""
    p.add_argument("--grpc-client", default=str(GrpcClient.NATIVE), choices=GrpcClient.values(),
                   help="-i grpc: the client that sends inference requests: native (our own HTTP/2 client, the "
                        "default) or aio (grpc-core through grpc.aio: the fallback if native misbehaves with a server)")
    p.add_argument("--streaming", action="store_true",
                   help="-i grpc: drive decoupled models over gRPC streams (ModelStreamInfer), closed loop; reports "
                        "first-response and inter-response latency and responses per request")
    tls = p.add_argument_group("TLS (perf_analyzer's flags; -i grpc: --ssl-grpc-*, -i http: --ssl-https-*)")
    tls.add_argument("--ssl-grpc-use-ssl", action="store_true", help="gRPC over TLS (implied by the files below)")
    for flag, what in zip(_GRPC_TLS + _HTTPS_TLS, ("server CA (PEM)", "client certificate (PEM)",
                                                   "client private key (PEM)") * 2, strict=True):
        tls.add_argument(flag, type=Path, default=None, metavar="FILE", help=what)
    tls.add_argument("--ssl-https-verify-peer", type=int, choices=(0, 1), default=1,
                     help="0: accept any server certificate (HTTP)")
    tls.add_argument("--ssl-server-name", default=None, metavar="NAME",
                     help="SNI and the name the server's certificate must carry (default: -u's host)")
    p.add_argument("--grpc-compression-algorithm", default="none", choices=("none", *ALGORITHMS),
                   help="-i grpc: requests compressed so (grpc-encoding), compressed answers accepted")
    p.add_argument("--http-compression-algorithm", default="none", choices=("none", *ALGORITHMS),
                   help="-i http: requests compressed so (Content-Encoding), answers asked so (Accept-Encoding)")


def _compression(args: argparse.Namespace, protocol: Protocol) -> str | None:
    own, other = ((args.grpc_compression_algorithm, "--http-compression-algorithm") if protocol is Protocol.GRPC
                  else (args.http_compression_algorithm, "--grpc-compression-algorithm"))
    if getattr(args, other[2:].replace("-", "_")) != "none":
        raise PerfClientError(f"{other}: not with -i {protocol}")
    return None if own == "none" else str(own)


def _tls(args: argparse.Namespace, protocol: Protocol) -> Tls | None:
    """The TLS settings of the protocol in use; None without any TLS flag. The other protocol's flags refused."""
    grpc_files = [getattr(args, f[2:].replace("-", "_")) for f in _GRPC_TLS]
    https_files = [getattr(args, f[2:].replace("-", "_")) for f in _HTTPS_TLS]
    grpc_on = args.ssl_grpc_use_ssl or any(grpc_files)
    https_on = any(https_files) or args.ssl_https_verify_peer == 0
    if (protocol is Protocol.GRPC and https_on) or (protocol is Protocol.HTTP and grpc_on):
        other, own = ("https", "grpc") if protocol is Protocol.GRPC else ("grpc", "https")
        raise PerfClientError(f"--ssl-{other}-*: not with -i {protocol} (use --ssl-{own}-*)")
    if protocol is Protocol.GRPC and grpc_on:
        ca, cert, key = grpc_files
        return Tls(ca_file=ca, cert_file=cert, key_file=key, server_name=args.ssl_server_name, flags=_GRPC_TLS)
    if protocol is Protocol.HTTP and https_on:
        ca, cert, key = https_files
        return Tls(ca_file=ca, cert_file=cert, key_file=key, server_name=args.ssl_server_name,
                   verify=args.ssl_https_verify_peer == 1, flags=_HTTPS_TLS)
    if args.ssl_server_name is not None:
        raise PerfClientError("--ssl-server-name: only with TLS (--ssl-grpc-use-ssl or the --ssl-* files)")
    return None


def _levels(args: argparse.Namespace) -> tuple[LoadLevel, ...]:
    if args.request_intervals is not None:
        if args.distribution != "constant":  # silently ignored otherwise
            raise PerfClientError(f"--distribution {args.distribution}: not with --request-intervals "
                                  "(the file gives the gaps)")
        replay = load_intervals(args.request_intervals)
        return (LoadLevel(request_rate=replay.rate, intervals=replay, max_inflight=args.max_inflight),)
    if args.request_rate is not None:
        distribution = Distribution.parse(args.distribution, "--distribution", error=PerfClientError)
        return (LoadLevel(request_rate=args.request_rate, distribution=distribution, max_inflight=args.max_inflight),)
    if args.concurrency_range:
        parts = args.concurrency_range.split(":")
        if len(parts) not in (2, 3) or not all(x.isdigit() for x in parts):
            raise PerfClientError(f"--concurrency-range {args.concurrency_range!r}: expected START:END[:STEP]")
        start, end, step = int(parts[0]), int(parts[1]), int(parts[2]) if len(parts) == 3 else 1
        if start < 1 or end < start or step < 1:
            raise PerfClientError(
                f"--concurrency-range {args.concurrency_range!r}: expected 1 <= START <= END, STEP >= 1"
            )
        return tuple(LoadLevel(concurrency=c) for c in range(start, end + 1, step))
    return (LoadLevel(concurrency=args.concurrency if args.concurrency is not None else 1),)


def _load_flag(args: argparse.Namespace) -> str | None:
    """The closed-loop load flag as typed, for SessionConfig's messages; None when none was given (the default)."""
    if args.concurrency_range:
        return f"--concurrency-range {args.concurrency_range}"
    if args.concurrency is not None:
        return f"--concurrency {args.concurrency}"
    return None


def _model_levels(args: argparse.Namespace) -> dict[str, tuple[LoadLevel, ...]]:
    """--model-concurrency MODEL=N and --model-request-rate MODEL=R: a model's own load level."""
    levels: dict[str, tuple[LoadLevel, ...]] = {}
    for flag, items in (("--model-concurrency", args.model_concurrency), ("--model-request-rate",
                                                                          args.model_request_rate)):
        for item in items:
            model, sep, value = item.rpartition("=")
            try:
                number = float(value) if flag == "--model-request-rate" else int(value)
            except ValueError:
                number = None
            if not sep or not model or number is None or model in levels:
                raise PerfClientError(f"{flag} {item!r}: expected MODEL=NUMBER, once per model")
            levels[model] = ((LoadLevel(request_rate=float(number), max_inflight=args.max_inflight),)
                             if flag == "--model-request-rate" else (LoadLevel(concurrency=int(number)),))
    return levels


def _input_data(args: argparse.Namespace) -> InputData:
    return InputData.parse(args.input_data or "random")


def _gpus(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    try:
        return parse_gpus(text)
    except ValueError as exc:
        raise PerfClientError(str(exc)) from None


def _validate_options(args: argparse.Namespace) -> ValidateOptions:
    # Given --input-data, the file's samples are sent among those payloads, not instead of them.
    return ValidateOptions(atol=args.validate_atol, rtol=args.validate_rtol, fraction=args.validate_fraction,
                           mix=args.validate is not None and args.input_data is not None)


def parse_config(argv: Sequence[str] | None) -> CliConfig:
    """argv -> a validated CliConfig; PerfClientError naming the flag otherwise (UsageConflict: two flags
    that do not go together, as SessionConfig decides)."""
    args = _parser().parse_args(argv)
    protocol = Protocol.parse(args.protocol, "-i", error=PerfClientError)
    session = SessionConfig(
        models=tuple(args.model), url=args.url or f"localhost:{protocol.default_port}", protocol=protocol,
        model_levels=_model_levels(args), simultaneous=args.simultaneous,
        levels=_levels(args), load_flag=_load_flag(args), batch=args.batch_size, input_data=_input_data(args),
        shapes=parse_shapes(args.shape),
        measurement=Measurement(measurement_ms=args.measurement_interval,
                                stability_percentage=args.stability_percentage, max_trials=args.max_trials,
                                warmup_requests=args.warmup, request_count=args.request_count),
        metrics_url=args.metrics_url,
        power_source=PowerSource.parse(args.power_source, "--power-source", error=PerfClientError),
        validate=args.validate, validate_options=_validate_options(args),
        shared_memory=SharedMemory(args.shared_memory, args.output_shared_memory_size,
                                   headers=request_headers(str(protocol), args.header)),
        request_timeout_ms=args.request_timeout_ms, time_limit_s=args.time_limit, processes=args.processes,
        seed=args.seed, gpus=_gpus(args.gpus), tls=_tls(args, protocol), compression=_compression(args, protocol),
        sequence=_sequence(args), grpc_client=args.grpc_client,
        streaming=args.streaming,
    )
    return CliConfig(session=session, json_path=args.json, csv_path=args.csv, plot_path=args.plot, html_path=args.html,
                     progress=not args.no_progress and not args.quiet, verbose=args.verbose, quiet=args.quiet)


def _write_outputs(config: CliConfig, rows: list[ModelResult], error: str | None = None) -> None:
    for flag, path in (("--json", config.json_path), ("--csv", config.csv_path), ("--plot", config.plot_path),
                       ("--html", config.html_path)):
        if path is None or (flag == "--plot" and not rows):
            continue
        try:
            if flag == "--json":
                write_json(path, documents(config.session, rows, error))
            elif flag == "--csv":
                # perf_analyzer's CSV is per model: the whole-run row of --simultaneous is in the JSON only.
                write_csv(path, [row for row in rows if row.model != WHOLE_RUN], streaming=config.session.streaming)
            elif flag == "--html":
                write_html(path, config.session, rows, error)
            else:
                plot(path, rows)
        except OSError as exc:
            raise PerfClientError(f"{flag} {path}: cannot write ({exc.strerror or exc})") from exc


def _measure(config: CliConfig) -> list[ModelResult]:
    # The session shows each level's windows through common.progress: a live bar on a terminal,
    # plain lines in a log, nothing with -q or --no-progress.
    progress.configure(progress.pick_mode(sys.stderr, enabled=config.progress))
    try:
        return run(config.session, ctrl_c_keeps_results=True)
    finally:
        progress.configure(progress.Mode.OFF)  # gone before the table or any message


def _error(message: object) -> int:
    print(f"perfclient: error: {message}", file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = parse_config(argv)
    except UsageConflict as exc:
        _error(exc)
        return 2  # a usage error, as argparse's own
    except PerfClientError as exc:
        return _error(exc)
    configure_logging(["client"], verbose=config.verbose, quiet=config.quiet)
    try:
        rows = _measure(config)
    except RunAborted as exc:
        try:
            _write_outputs(config, exc.partial, str(exc))
        except PerfClientError as write_error:
            _error(write_error)
        if exc.partial:
            print(table(exc.partial))
        return _error(exc)
    except PerfClientError as exc:
        return _error(exc)
    except KeyboardInterrupt:
        print("perfclient: interrupted", file=sys.stderr)
        return 130
    print(table(rows))
    try:
        _write_outputs(config, rows)
    except PerfClientError as exc:
        return _error(exc)
    unstable = [f"{row.model} {row.result.level.label}" for row in rows if not row.result.stable]
    if unstable:
        m = config.session.measurement
        print(f"note: not stable within ±{m.stability_percentage:g} % after {m.max_trials} windows: "
              f"{', '.join(unstable)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
