"""`trtbuild`: build engines from models.toml or a user's ONNX, and run the bundled Triton server."""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from builder.errors import BuilderError, ManifestError, ServerError, VariantsFailed
from builder.spec import (
    ModelSpec,
    Precision,
    RuntimeChoice,
    ServingBackend,
    check_model_name,
    load_manifest,
    parse_precisions,
    variant_name,
)
from builder.spec.enums import GuardSensitivity
from builder.spec.flags import CALIBRATION_SAMPLES, BuildFlags, spec_from_flags
from builder.steps.budget import DEFAULT_GUARD_BUDGET_S
from client import cli_env  # noqa: F401  (the command's process-wide settings, before any grpc import)
from common import progress
from common.logs import active_log_file, close_log_file, configure_logging, default_log_file, native_stderr_to_log

if TYPE_CHECKING:  # imported where used: the CLI's start stays light
    from builder.serving.triton_server import TritonServer


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trtbuild", description=__doc__)
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="debug output from trtbuild (-vv: from libraries too)")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    # The same flags after the subcommand (`trtbuild build -v ...`); SUPPRESS keeps the values above.
    verbosity = argparse.ArgumentParser(add_help=False)
    verbosity.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    verbosity.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)

    def common_build(p: argparse.ArgumentParser) -> None:
        p.add_argument("--repository", type=Path, default=Path("model_repository"), help="Triton model repository")
        p.add_argument("--report", type=Path, default=None,
                       help="build report JSON (default: REPOSITORY/build_report.json)")
        p.add_argument("--runtime", default="auto",
                       help="auto | onnxruntime | onnxruntime-cuda | tensorrt (default: auto: TensorRT, else "
                            "ONNX Runtime CUDA where onnxruntime-gpu and a GPU exist, else CPU)")
        p.add_argument("--serving-backend", default="python",
                       help="python (bundled Triton + ONNX Runtime) | onnxruntime (NGC image's native backend)")
        p.add_argument("--force", action="store_true", help="rebuild even when inputs are unchanged")
        p.add_argument("--no-wait", action="store_true",
                       help="fail at once when another build or tune is writing the repository (default: wait)")
        p.add_argument("--tolerance", action="append", default=[], metavar="PREC:METRIC=VALUE[,...]",
                       help="accuracy limits over models.toml's and the defaults, e.g. "
                            "fp16:cosine_min=0.998,int8:top1_agreement_min=0.9 (metrics: max_abs, max_rel, "
                            "cosine_min, cosine_mean_min, top1_agreement_min, detection_agreement_min; repeatable)")
        p.add_argument("--no-guard", action="store_true",
                       help="no accuracy guard: an FP16 or INT8 variant that misses its tolerance is not written "
                            "(default: search for the nodes to keep in higher precision, then check again)")
        p.add_argument("--all-or-nothing", action="store_true",
                       help="write nothing unless every variant passes (default: write each variant that "
                            "passes, list those that fail, exit 1)")
        p.add_argument("--guard-sensitivity", default=GuardSensitivity.ONE_PASS.value,
                       help="how the accuracy guards rank nodes: one-pass (one run of the FP32 and the converted "
                            "graph) or exhaustive (one conversion per node; slow); default: one-pass")
        p.add_argument("--guard-budget", type=float, default=DEFAULT_GUARD_BUDGET_S, metavar="SECONDS",
                       help="each accuracy guard's search stops after this many seconds and keeps the best mix "
                            "found within it (0: no bound; default: %(default)g)")
        p.add_argument("--log", type=Path, default=None, metavar="FILE",
                       help="build log: every library's output and our debug lines "
                            "(default: .logs/build-<UTC time>-<pid>.log)")
        trt = p.add_argument_group("TensorRT (with --runtime tensorrt, or auto where TensorRT and a GPU exist)")
        trt.add_argument("--trt-workspace-mib", type=int, default=4096, help="workspace memory-pool limit")
        trt.add_argument("--trt-optimization-level", type=int, default=3, help="builder optimization level 0-5")
        trt.add_argument("--trt-version-compatible", action="store_true", help="plans for later TensorRT versions")
        trt.add_argument("--trt-hardware-compatibility", default="none",
                         help="none | ampere_plus | same_compute_capability")
        trt.add_argument("--trt-cuda-graphs", action="store_true", help="enable CUDA graphs in config.pbtxt")
        trt.add_argument("--no-trt-warmup", action="store_true", help="no model_warmup in config.pbtxt")
        cuda = p.add_argument_group(
            "ONNX Runtime CUDA (with --runtime onnxruntime-cuda, or auto on a GPU without TensorRT)")
        cuda.add_argument("--cudnn-conv-algo-search", default="HEURISTIC", help="HEURISTIC | EXHAUSTIVE | DEFAULT")
        cuda.add_argument("--no-cuda-graphs", action="store_true", help="python runner: no CUDA graph per bucket")
        cuda.add_argument("--cuda-layout", default="auto",
                          help="auto | nhwc | nchw: convolution layout (auto: NHWC for FP16, and FP32 with TF32)")
        cuda.add_argument("--cuda-tf32", default="auto",
                          help="auto | on | off: TF32 math in FP32 convolutions, matmuls (auto: off for FP32 graphs)")
        cuda.add_argument("--ort-tensorrt-fp16", action="store_true",
                          help="native onnxruntime backend: gpu_execution_accelerator tensorrt, FP16")

    engines = sub.add_parser("engines", parents=[verbosity], help="build every model in the manifest")
    engines.add_argument("--manifest", type=Path, default=Path("models.toml"))
    engines.add_argument("--only", action="append", default=[], metavar="NAME", help="build only NAME (repeatable)")
    common_build(engines)

    build = sub.add_parser("build", parents=[verbosity], help="build a user's ONNX model")
    build.add_argument("--onnx", type=Path, required=True)
    build.add_argument("--name", default=None,
                       help="Triton model name (default: the ONNX file's name without extension)")
    build.add_argument("--precision", default=None,
                       help="comma-separated fp32,fp16,int8 (default: fp32,fp16, plus int8 with --calibration)")
    build.add_argument("--calibration", type=Path,
                       help=".npz keyed by input name, leading sample axis (or module:function, as in models.toml)")
    build.add_argument("--calibration-method", default=None,
                       help="with --calibration: entropy | max (default: entropy)")
    build.add_argument("--calibration-samples", type=int, default=None,
                       help=f"with --calibration: samples used at most (default: {CALIBRATION_SAMPLES})")
    build.add_argument("--int8-recipe", default=None,
                       help="with --calibration: auto (by runtime and model class, the default) | modelopt | "
                            "onnxruntime | onnxruntime-dynamic")
    build.add_argument("--eval-data", type=Path,
                       help="held-out .npz, or module:function (default: last quarter of --calibration)")
    build.add_argument("--max-batch", type=int, default=None,
                       help="largest batch (default: the shapes' axis 0, else 16)")
    build.add_argument("--dim", action="append", default=[], metavar="NAME=MIN:OPT:MAX",
                       help="range of a dynamic non-batch dim (repeatable)")
    shapes = build.add_argument_group(
        "shapes per input, trtexec style (NAME:DxDxD[,NAME:DxDxD...]; the batch first for batching models)")
    shapes.add_argument("--shapes", action="append", default=[], metavar="NAME:DxD",
                        help="fixed shapes (min = opt = max)")
    shapes.add_argument("--min-shapes", action="append", default=[], metavar="NAME:DxD")
    shapes.add_argument("--opt-shapes", action="append", default=[], metavar="NAME:DxD",
                        help="a missing min or max is the opt")
    shapes.add_argument("--max-shapes", action="append", default=[], metavar="NAME:DxD")
    build.add_argument("--input-range", action="append", default=[], metavar="NAME:LOW:HIGH",
                       help="values of synthetic samples for an integer input (repeatable)")
    build.add_argument("--no-batch", action="store_true",
                       help="serve with max_batch_size 0 and whole shapes (automatic when axis 0 cannot batch)")
    build.add_argument("--task", default="generic",
                       help="classification | detection | embedding | generic (detection: an output [batch, K, 6+] "
                            "of x1, y1, x2, y2, score, class, matched as sets)")
    common_build(build)

    serve = sub.add_parser("serve", parents=[verbosity], help="run the bundled Triton server on the repository")
    serve.add_argument("--repository", type=Path, default=Path("model_repository"))
    serve.add_argument("--state-dir", type=Path, default=Path(".run"),
                       help="log, server record (tritonserver.json), backend folder")
    serve.add_argument("--http-port", type=int, default=8000)
    serve.add_argument("--grpc-port", type=int, default=8001)
    serve.add_argument("--metrics-port", type=int, default=8002)
    serve.add_argument("--background", action="store_true", help="return once /v2/health/ready answers 200")
    serve.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for readiness")
    serve.add_argument("--model-control", default="none",
                       help="none (load every model at start) | explicit (load on request: what "
                            "`trtbuild tune --url` and Model Analyzer's remote mode need)")
    serve.add_argument("--listen", default=None, metavar="ADDRESS",
                       help="bind HTTP, gRPC and metrics to this IPv4 address (default 127.0.0.1: this host only; "
                            "0.0.0.0: every interface). Beyond loopback the model-repository, shared-memory, "
                            "logging and trace APIs need the header triton-admin-key")
    serve.add_argument("--admin-key-file", type=Path, default=None, metavar="FILE",
                       help="with --listen: the admin key, in a file of yours with mode 0600 (default: "
                            "$TRITON_ADMIN_KEY, else a new key in STATE_DIR/admin-key)")
    serve.add_argument("--no-restrict", action="store_true",
                       help="with --listen: leave the restricted APIs open to anyone who reaches the server")
    serve.add_argument("--mps", action=argparse.BooleanOptionalAction, default=None,
                       help="run the GPU models' processes under CUDA MPS (a control daemon of this state folder, "
                            "quit when the server stops): the python runner's instances then share the GPU at "
                            "once instead of taking turns. Default: on where the repository has python-runner "
                            "models on a GPU, nvidia-cuda-mps-control exists, no daemon of the host's already "
                            "serves them and no GPU gets more than 48 of their instances (a daemon that does not "
                            "start is then a warning); --mps insists, --no-mps turns it off (docs/gpu.md)")
    serve.add_argument("--gpus", default=None, metavar="LIST",
                       help="serve the GPU variants on these GPUs (device ids: 0,3), each variant's instance count "
                            "on every one of them (rewrites their config.pbtxt instance groups first)")

    tune = sub.add_parser("tune", parents=[verbosity],
                          help="measure serving configurations and write the best into the repository")
    tune.add_argument("name", help="model name from models.toml (variants NAME_<precision>)")
    tune.add_argument("--repository", type=Path, default=Path("model_repository"))
    tune.add_argument("--manifest", type=Path, default=Path("models.toml"),
                      help="the winner is kept in tuned.toml beside it, which `trtbuild engines` layers over it")
    tune.add_argument("--url", default=None, metavar="HOST:PORT",
                      help="tune this running Triton (HTTP; started with explicit model control) instead of a "
                           "private one; the winner is written to --repository and loaded on it")
    tune.add_argument("--grpc-url", default=None, metavar="HOST:PORT", help="with --url (default: HOST:8001)")
    tune.add_argument("--metrics-url", default=None, help="with --url (default: http://HOST:8002/metrics)")
    tune.add_argument("--admin-key-file", type=Path, default=None, metavar="FILE",
                      help="with --url: the key of a server whose repository API is restricted, in a file of "
                           "yours with mode 0600 (default: $TRITON_ADMIN_KEY)")
    tune.add_argument("--precisions", default="fp32,fp16,int8", help="variants to consider")
    tune.add_argument("--max-batch", default="1,4,8,16", help="max_batch_size values")
    tune.add_argument("--queue-delay-us", default="off,0,1000,4000",
                      help="dynamic batching max_queue_delay_microseconds values; off = no dynamic batching")
    tune.add_argument("--instances", default=None,
                      help="instance counts (default: 1,2 and the as-built count, 4 per GPU for the python runner "
                           "on CUDA)")
    tune.add_argument("--concurrency", default="32", help="client concurrencies, comma-separated")
    tune.add_argument("--objective", default="throughput", help="throughput | p99 | infer_per_joule")
    tune.add_argument("--p99-budget-ms", type=float, default=None)
    tune.add_argument("--min-throughput", type=float, default=None)
    tune.add_argument("--search", default="hill", help="hill | exhaustive | tpe (optuna, --trials points)")
    tune.add_argument("--trials", type=int, default=12, help="with --search tpe: points measured at most")
    tune.add_argument("--seed", type=int, default=0, help="with --search tpe: the sampler's seed")
    tune.add_argument("--gpus", default=None, metavar="LIST",
                      help="meter these GPUs (indices or UUIDs: 0,3); default: those the variant's instance groups "
                           "name, else CUDA_VISIBLE_DEVICES, else every GPU")
    tune.add_argument("--mps", action=argparse.BooleanOptionalAction, default=None,
                      help="tune's private server under CUDA MPS or not; default: as `trtbuild serve` decides by "
                           "itself (docs/gpu.md)")
    tune.add_argument("--measurement-interval", type=int, default=3000, help="ms per window")
    tune.add_argument("--max-trials", type=int, default=6, help="windows per measurement at most")
    tune.add_argument("--report", type=Path, default=None, help="JSON (default: reports/tune_NAME.json)")
    tune.add_argument("--plot", type=Path, default=None, help="PNG (default: reports/tune_NAME.png)")
    tune.add_argument("--html", type=Path, default=None,
                      help="self-contained HTML report: points, Pareto front, the pick and why "
                           "(default: reports/tune_NAME.html)")
    tune.add_argument("--dry-run", action="store_true",
                      help="measure, report and show the change; write neither config.pbtxt nor tuned.toml")
    tune.add_argument("--no-compare", action="store_true", help="skip the side-by-side re-measurement")
    tune.add_argument("--no-wait", action="store_true",
                      help="fail at once when another build or tune is writing the repository (default: wait)")

    verify = sub.add_parser("verify", parents=[verbosity],
                            help="compare the server's gRPC and HTTP answers with ONNX Runtime")
    verify.add_argument("--manifest", type=Path, default=None,
                        help="models.toml (default: ./models.toml where it exists; models it does not list, "
                             "and every model without one, are read from their variants' build.json)")
    verify.add_argument("--repository", type=Path, default=Path("model_repository"))
    verify.add_argument("--http-url", default="localhost:8000")
    verify.add_argument("--grpc-url", default="localhost:8001")
    verify.add_argument("--samples", type=int, default=16, help="held-out samples per variant")
    verify.add_argument("--admin-key-file", type=Path, default=None, metavar="FILE",
                        help="the key of a server with restricted APIs (sent as triton-admin-key), in a file of "
                             "yours with mode 0600 (default: $TRITON_ADMIN_KEY)")
    verify.add_argument("--save", type=Path, default=None, metavar="FILE.npz",
                        help="write the samples sent and the outputs expected, for perfclient --validate")
    verify.add_argument("--only", action="append", default=[], metavar="NAME", help="verify only NAME (repeatable)")
    verify.add_argument("--state-dir", type=Path, default=Path(".run"),
                        help="where `trtbuild serve` recorded the server: named with its log if it dies")

    sub.add_parser("schema", parents=[verbosity],
                   help="print models.toml's JSON Schema (for editors: trtbuild schema > models.schema.json)")

    stop = sub.add_parser("stop", parents=[verbosity], help="stop a server started with serve --background")
    stop.add_argument("--state-dir", type=Path, default=Path(".run"))
    return parser


def _build(args: argparse.Namespace, specs: list[ModelSpec]) -> int:
    from builder.pipeline import BuildOptions, ModelStatus, build_all
    from builder.runtimes import CudaOptions, select
    from builder.runtimes.tensorrt_plan import HardwareCompatibility, TrtBuildOptions
    from builder.spec.tolerances import parse_tolerances, with_tolerances

    limits: dict[Precision, dict[str, float]] = {}
    for value in args.tolerance:
        for prec, given in parse_tolerances(value, "--tolerance").items():
            twice = sorted(set(given) & set(limits.get(prec, {})))
            if twice:
                raise ManifestError(f"--tolerance: {prec.value}:{twice[0]} is given twice (in two --tolerance "
                                    "flags); expected it once")
            limits.setdefault(prec, {}).update(given)
    unused = [prec.value for prec in limits if not any(prec in spec.precisions for spec in specs)]
    if unused:
        made = sorted({p.value for spec in specs for p in spec.precisions}, key=[p.value for p in Precision].index)
        raise ManifestError(f"--tolerance {unused[0]}: no model of this build makes an {unused[0]} variant "
                            f"(they make {', '.join(made)})")
    specs = [with_tolerances(spec, limits) for spec in specs]
    if args.no_guard:
        specs = [replace(spec, guard=False) for spec in specs]
    runtime_choice = RuntimeChoice.parse(args.runtime, "--runtime", error=ManifestError)
    serving_backend = ServingBackend.parse(args.serving_backend, "--serving-backend", error=ManifestError)
    trt_options = TrtBuildOptions(
        workspace_mib=args.trt_workspace_mib, optimization_level=args.trt_optimization_level,
        version_compatible=args.trt_version_compatible,
        hardware_compatibility=HardwareCompatibility.parse(args.trt_hardware_compatibility,
                                                           "--trt-hardware-compatibility", error=ManifestError),
        cuda_graphs=args.trt_cuda_graphs, warmup=not args.no_trt_warmup,
    ).check()
    # The build log the CLI opened (common.logs: the CLI sets it): tools' output and the runtime's messages go
    # there and the one-line errors name it.
    build_log = active_log_file()
    options = BuildOptions(repository=args.repository, force=args.force, wait=not args.no_wait, log_file=build_log,
                           all_or_nothing=args.all_or_nothing,
                           spec_origin="build flags" if args.command == "build" else "models.toml entry",
                           guard_sensitivity=GuardSensitivity.parse(args.guard_sensitivity, "--guard-sensitivity",
                                                                    error=ManifestError),
                           guard_budget_s=_guard_budget(args.guard_budget),
                           runtime=select(runtime_choice, serving_backend=serving_backend, trt_options=trt_options,
                                          log_file=build_log,
                                          cuda_options=CudaOptions(cudnn_conv_algo_search=args.cudnn_conv_algo_search,
                                                                   cuda_graphs=not args.no_cuda_graphs,
                                                                   tensorrt_fp16=args.ort_tensorrt_fp16,
                                                                   layout=args.cuda_layout, tf32=args.cuda_tf32)))
    if args.command == "engines":  # `trtbuild tune`'s winners (tuned.toml beside the manifest) are kept
        from builder.spec.tuned import load_tuned, tuned_path

        options.tuned = load_tuned(tuned_path(args.manifest))
        built = {variant_name(spec.name, prec) for spec in specs for prec in spec.precisions}
        for entry in options.tuned.values():
            # A precision since removed from models.toml: say so rather than drop the entry silently.
            if entry.model in {spec.name for spec in specs} and entry.variant not in built:
                logging.getLogger("builder.cli").warning(
                    "%s: [%s] names %s, which models.toml does not build; not applied",
                    tuned_path(args.manifest), entry.model, entry.variant)
    report = args.report or args.repository / "build_report.json"
    # Libraries' native output (ONNX Runtime, TensorRT) goes to the build log while the build runs.
    with native_stderr_to_log():
        results = build_all(specs, options, report, ["trtbuild", *sys.argv[1:]])
    from builder.summary import FailedVariant, render, summarize

    failures = [f for result in results for f in result.failures]
    render(summarize(results, specs, repository=args.repository, report=report, log_file=build_log,
                     manifest=getattr(args, "manifest", None), whole_manifest=not getattr(args, "only", None),
                     failures=[FailedVariant(f.variant, f.precision.value, f.reason) for f in failures]), sys.stdout)
    # One line per failure on stderr (a model that failed before its variants: one line for the model).
    lines = [result.error for result in results if result.status is ModelStatus.FAILED and result.error]
    lines += [f.line() for result in results if result.status is not ModelStatus.FAILED for f in result.failures]
    if lines:
        raise VariantsFailed("\n".join(lines))
    return 0


def _int_list(value: str, flag: str) -> tuple[int, ...]:
    items = []
    for part in value.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise ManifestError(f"{flag} {value!r}: expected comma-separated positive integers")
        items.append(int(part))
    return tuple(dict.fromkeys(items))


def _delays(value: str, flag: str) -> tuple[int | None, ...]:
    """Queue delays in µs; `off` (None) means no dynamic batching."""
    items: list[int | None] = []
    for part in value.split(","):
        part = part.strip()
        if part == "off":
            items.append(None)
        elif part.isdigit():
            items.append(int(part))
        else:
            raise ManifestError(f"{flag} {value!r}: expected comma-separated integers (µs) or off")
    return tuple(dict.fromkeys(items))


def _guard_budget(value: float) -> float | None:
    if not math.isfinite(value) or value < 0:
        raise ManifestError(f"--guard-budget {value:g}: expected seconds, 0 or more (0: no bound)")
    return value or None


def _positive(value: float, flag: str) -> float:
    if value <= 0:
        raise ManifestError(f"{flag} {value:g}: expected a positive number")
    return value


def _host_port(value: str, flag: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ManifestError(f"{flag} {value!r}: expected HOST:PORT")
    return host, int(port)


def _writable(path: Path, flag: str) -> None:
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ManifestError(f"{flag} {path}: cannot create {folder} ({exc.strerror or exc})") from exc
    if not os.access(folder, os.W_OK) or path.is_dir():
        raise ManifestError(f"{flag} {path}: cannot write there")


_TUNE_ROWS = 12  # points listed whole; a longer search lists the Pareto front, the winner and failures


def _tune(args: argparse.Namespace) -> int:
    from builder.serving.exposure import client_key
    from builder.spec.tuned import load_tuned, tuned_path
    from builder.tuning.control import Endpoints
    from builder.tuning.objective import Goal, Objective
    from builder.tuning.points import Space
    from builder.tuning.report import energy_gaps
    from builder.tuning.run import TuneConfig, tune
    from builder.tuning.strategies import Search

    name = check_model_name(args.name, "tune NAME")
    precisions = parse_precisions(args.precisions, "--precisions")
    goal = Goal.parse(args.objective, "--objective", error=ManifestError)
    search = Search.parse(args.search, "--search", error=ManifestError)
    axes = (_int_list(args.max_batch, "--max-batch"), _delays(args.queue_delay_us, "--queue-delay-us"),
            _int_list(args.instances if args.instances is not None else "1,2", "--instances"))
    concurrencies = _int_list(args.concurrency, "--concurrency")
    gpus = _metered_gpus(args.gpus)
    budget = _positive(args.p99_budget_ms, "--p99-budget-ms") * 1000 if args.p99_budget_ms is not None else None
    floor = _positive(args.min_throughput, "--min-throughput") if args.min_throughput is not None else None
    if args.measurement_interval < 1 or args.max_trials < 1:
        raise ManifestError(f"--measurement-interval {args.measurement_interval} / --max-trials {args.max_trials}: "
                            "expected positive integers")
    if args.trials < 1:
        raise ManifestError(f"--trials {args.trials}: expected a positive integer")
    attach = None
    if args.url is not None:
        host, _ = _host_port(args.url, "--url")
        grpc = args.grpc_url or f"{host}:8001"
        _host_port(grpc, "--grpc-url")
        metrics = args.metrics_url or f"http://{host}:8002/metrics"
        if not metrics.startswith(("http://", "https://")):
            raise ManifestError(f"--metrics-url {metrics!r}: expected http://HOST:PORT/metrics")
        attach = Endpoints(args.url, grpc, metrics, key=client_key(args.admin_key_file))
    elif args.grpc_url or args.metrics_url or args.admin_key_file:
        raise ManifestError("--grpc-url/--metrics-url/--admin-key-file: only with --url (a running server to tune)")
    if args.mps is not None and args.url:
        raise ManifestError(f"--{'' if args.mps else 'no-'}mps: only for tune's private server; with --url, start "
                            "that server with `trtbuild serve --mps` or `--no-mps`")
    specs = {spec.name: spec for spec in load_manifest(args.manifest)}
    if name not in specs:
        raise ManifestError(f"tune {name}: not in {args.manifest} (models: {', '.join(specs)})")
    variants = tuple(variant_name(name, p) for p in precisions if (args.repository / variant_name(name, p)).is_dir())
    if not variants:
        raise ManifestError(f"tune {name}: no variant of it in {args.repository}; run `trtbuild engines` first")
    space = Space(variants, *axes)
    objective = Objective(goal, budget, floor)
    report_path = args.report or Path("reports") / f"tune_{name}.json"
    plot_path = args.plot or Path("reports") / f"tune_{name}.png"
    html_path = args.html or Path("reports") / f"tune_{name}.html"
    tuned_toml = tuned_path(args.manifest)
    # Before minutes of measuring: a tuned.toml the winner cannot be written into, or a report that
    # cannot be written, is one line now rather than after the search.
    load_tuned(tuned_toml)
    for flag, path in (("--report", report_path), ("--plot", plot_path), ("--html", html_path)):
        _writable(path, flag)
    config = TuneConfig(args.repository, space, objective, search=search, concurrencies=concurrencies,
                        measurement_ms=args.measurement_interval, default_variant=variants[0],
                        report_path=report_path, plot_path=plot_path, html_path=html_path,
                        write=not args.dry_run, compare=not args.no_compare, max_trials=args.max_trials,
                        wait=not args.no_wait, attach=attach, model=name, tuned_toml=tuned_toml,
                        trials=args.trials, seed=args.seed, gpus=gpus,
                        measure_built_instances=args.instances is None, mps=args.mps)
    # SIGTERM (a pod's stop, `timeout`) ends the run as Ctrl-C does: the private server and its folder
    # are removed, an attached server's models restored, and the report of what was measured written.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        report = tune(config)
    finally:
        signal.signal(signal.SIGTERM, previous)
    # A long search lists the Pareto front, the winner and failed points; the report and page hold every point.
    winner_label = report.winner.label() if report.winner else None
    shown = [e for e in report.points if len(report.points) <= _TUNE_ROWS or e.label in report.pareto
             or e.failure or e.restarts or e.label == winner_label]
    print(f"{'point':<58} {'infer/s':>8} {'p99 ms':>8} {'feasible':>8}")
    for entry in shown:
        p99 = "-" if entry.p99_ms is None else f"{entry.p99_ms:.1f}"
        failure = f"  failed: {entry.failure}" if entry.failure else ""
        failure += "".join(f"  re-measured: {note}" for note in entry.restarts)
        print(f"{entry.label:<58} {entry.throughput:>8.1f} {p99:>8} {'yes' if entry.feasible else 'no':>8}{failure}")
    # Ranked on the concurrencies whose energy is known; below every point with a figure when none is.
    for m in energy_gaps(report):
        print(f"{m.label:<58} {m.energy} (a window's energy read failed or did not advance)")
    failed = f", {report.failed} failed" if report.failed else ""
    if report.restarts:
        failed += f", {report.restarts} server restart{'s' if report.restarts != 1 else ''} (see the points)"
    hidden = f" ({len(report.points) - len(shown)} points off it not listed)" if len(shown) < len(report.points) else ""
    print(f"{report.search} search: {report.measurements} measurements{failed}; "
          f"Pareto front: {len(report.pareto)} points{hidden}")
    print(f"why: {report.why}")
    if report.mps_note:
        print(f"warning: CUDA MPS off for tune's server: {report.mps_note} (--no-mps silences this)")
    for row in report.comparison:
        p99 = "-" if row.p99_ms is None else f"{row.p99_ms:.1f}"
        print(f"side by side: {row.config:<20} {row.throughput:>8.1f} infer/s  p99 {p99:>7} ms  "
              f"{'meets' if row.feasible else 'misses'} the constraints  ({row.label})")
    if args.dry_run:
        for change in report.changes:
            print(change, end="" if change.endswith("\n") else "\n")
    written = ""
    if report.winner is not None:
        where = f"{args.repository / report.winner.variant} and {tuned_toml}"
        if attach is not None:
            where += f", loaded on {attach.http}"
        written = "not written (--dry-run; the change is shown above)" if args.dry_run else f"written to {where}"
    label = report.winner.label() if report.winner else "-"
    print(f"winner: {label} {written}; report {report_path}, plot {plot_path}, page {html_path}")
    return 0


def _metered_gpus(text: str | None) -> tuple[str, ...] | None:
    from client.power import parse_gpus

    try:
        return parse_gpus(text) if text is not None else None
    except ValueError as exc:
        raise ManifestError(str(exc)) from None


def _serve(args: argparse.Namespace) -> int:
    from builder.serving.exposure import KEY_HEADER, RESTRICTED, exposure
    from builder.serving.triton_server import ModelControl, Ports, TritonServer, exit_text

    # start() records the server in STATE_DIR/tritonserver.json, refuses while the recorded one runs,
    # and cleans (with a warning line) the stubs and /dev/shm regions a dead one left behind.
    ports = Ports(args.http_port, args.grpc_port, args.metrics_port)
    control = ModelControl.parse(args.model_control, "--model-control", error=ManifestError)
    if args.listen is None and (args.no_restrict or args.admin_key_file is not None):
        raise ManifestError("--no-restrict/--admin-key-file: only with --listen ADDRESS (loopback needs no key)")
    exposed, key_source = exposure(args.listen, restrict=not args.no_restrict, key_file=args.admin_key_file,
                                   state_dir=args.state_dir)
    if exposed.exposed and key_source is not None:
        print(f"listening on {exposed.address} (beyond this host): the {', '.join(RESTRICTED)} APIs need the "
              f"header {KEY_HEADER} (key from {key_source})")
    elif exposed.exposed:
        print(f"warning: listening on {exposed.address} with --no-restrict: anyone who reaches it can load and "
              "unload models, register shared memory and change logging and tracing")
    if args.gpus is not None:
        from builder.repository.gpus import check_present, parse_gpu_list, place_on_gpus, visible_gpus
        from builder.serving import triton_server

        gpus = parse_gpu_list(args.gpus)
        # Before rewriting: a GPU that is not here would stay in the configs, failing every later serve.
        check_present(gpus, visible_gpus(triton_server.gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES")))
        for path in place_on_gpus(args.repository, gpus):
            print(f"{path.parent.name}: instances on GPUs {', '.join(map(str, gpus))}")
    server = TritonServer(args.repository, args.state_dir, ports, model_control=control, exposure=exposed,
                          mps=args.mps)
    # Triton loads nothing by itself in explicit mode: say how to load, rather than leave an empty server.
    note = (f"model control explicit: no model is loaded at start; load one with POST "
            f"http://127.0.0.1:{ports.http}/v2/repository/models/NAME/load, or `trtbuild tune NAME --url "
            f"127.0.0.1:{ports.http}`" if control is ModelControl.EXPLICIT else None)
    if args.background:
        server.start(timeout=args.timeout, detach=True)
        assert server.process is not None
        print(f"tritonserver ready: http :{ports.http}, grpc :{ports.grpc}, metrics :{ports.metrics} "
              f"(pid {server.process.pid}, log {server.log_file}); `trtbuild stop` stops it")
        for line in filter(None, (_mps_line(args, server), note)):
            print(line)
        return 0
    server.start(timeout=args.timeout)
    assert server.process is not None
    # Flushed: whoever reads a piped stdout (a supervisor, a test) learns the server is up now, not at exit.
    print(f"tritonserver ready: http :{ports.http}, grpc :{ports.grpc}, metrics :{ports.metrics}; "
          "Ctrl-C stops it", flush=True)
    for line in filter(None, (_mps_line(args, server), note)):
        print(line, flush=True)
    try:
        code = server.process.wait()
        if code != 0:  # it died (a crash inside tritonserver, the OOM killer): one line, then what it wrote last
            print(f"trtbuild: error: tritonserver (pid {server.process.pid}) {exit_text(code)}; the last lines "
                  f"it wrote ({server.log_file}):", file=sys.stderr)
            for line in server.last_lines(12):
                print(f"  {line}", file=sys.stderr)
            return 1
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()  # also when it exited by itself: removes the record, cleans stubs it left


def _mps_line(args: argparse.Namespace, server: TritonServer) -> str | None:
    """Under MPS: where the daemon runs and whether the server's processes reached it (a CUDA process that
    does not reach it runs without MPS and says nothing). By default without it: why, where it would matter."""
    from builder.serving import mps

    if not server.mps_used:
        return (f"warning: CUDA MPS off: {server.mps_note}; the python runner's GPU instances take turns on the "
                "GPU (--no-mps silences this)" if server.mps_note else None)
    folder = args.state_dir / mps.FOLDER
    count = mps.clients(args.state_dir)
    if count == 0:
        return (f"warning: CUDA MPS: no process has connected to the daemon ({folder}); the GPU models "
                "run without it")
    return (f"CUDA MPS: control daemon in {folder}, {count} client processes so far; stopped with the server"
            + ("" if args.mps else " (on by default for python-runner models on a GPU; --no-mps turns it off)"))


def _verify_specs(manifest: Path | None, repository: Path, only: list[str]) -> list[ModelSpec]:
    """The models to verify: models.toml's (the one given, else ./models.toml where it exists), and models
    it does not list (every model where there is none: `build --onnx`) from their variants' build.json."""
    from builder.serving.verify import specs_from_records

    source = manifest if manifest is not None else Path("models.toml")
    specs = load_manifest(source) if manifest is not None or source.is_file() else []
    # ./models.toml of another repository (none of its models is in this one): the build.json only.
    other = manifest is None and bool(specs) and not any(
        (repository / variant_name(s.name, p)).is_dir() for s in specs for p in s.precisions)
    if other:
        specs = []
    listed = {s.name for s in specs}
    if not specs or set(only) - listed:
        specs += [s for s in specs_from_records(repository) if s.name not in listed and (not specs or s.name in only)]
    where = f"{source} or the build.json in {repository}" if listed else f"the build.json in {repository}"
    if not specs:
        manifests = f"none of the models in {source} is there" if other else "no models.toml"
        raise ManifestError(f"{repository}: no model to verify: {manifests} and no build.json in the repository; "
                            "expected `trtbuild build` (or `trtbuild engines`) first")
    unknown = sorted(set(only) - {s.name for s in specs})
    if unknown:
        raise ManifestError(f"--only {', '.join(unknown)}: not in {where} "
                            f"(models: {', '.join(s.name for s in specs)})")
    return [s for s in specs if not only or s.name in only]


def _verify(args: argparse.Namespace) -> int:
    from builder.serving.exposure import client_key
    from builder.serving.triton_server import dead_server_lines
    from builder.serving.verify import check_models, expected_archive, npz_bytes, table_lines
    from client.protocol import Protocol
    from common.files import write_atomic

    if args.save is not None and args.save.suffix != ".npz":
        raise ManifestError(f"--save {args.save}: expected a path ending in .npz")
    specs = _verify_specs(args.manifest, args.repository, args.only)
    try:
        checks = check_models([s for s in specs if not args.only or s.name in args.only], args.repository,
                              {Protocol.GRPC: args.grpc_url, Protocol.HTTP: args.http_url}, args.samples,
                              key=client_key(args.admin_key_file))
    except ServerError as exc:
        dead = dead_server_lines(args.state_dir)  # the server `trtbuild serve` started died: say so, and its log
        if not dead:
            raise
        print(f"trtbuild: error: {exc}; {dead[0]}", file=sys.stderr)
        for line in dead[1:]:
            print(line, file=sys.stderr)
        return 1
    results = [r for check in checks for r in check.results]
    for line in table_lines(checks):
        print(line)
    if args.save is not None:
        # Written also when answers differ: the file holds what the local run expects, not what the server said.
        try:
            write_atomic(args.save, npz_bytes(expected_archive(checks)))
        except OSError as exc:
            raise BuilderError(f"--save {args.save}: cannot write ({exc.strerror or exc})") from exc
        print(f"saved inputs and expected outputs of {len(checks)} variants to {args.save} "
              f"(perfclient --validate {args.save})")
    bad = [f"{r.variant} ({r.protocol})" for r in results if not r.ok]
    if bad:
        raise BuilderError(f"server answers differ from ONNX Runtime for {', '.join(bad)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    log_file = (args.log or default_log_file()) if args.command in ("engines", "build") else None
    try:
        configure_logging(("builder", "client"), verbose=args.verbose, quiet=args.quiet, log_file=log_file)
    except OSError as exc:
        print(f"trtbuild: error: --log {log_file}: cannot write ({exc.strerror or exc})", file=sys.stderr)
        return 1
    progress.configure(progress.pick_mode(sys.stderr, quiet=args.quiet))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        if args.command == "schema":
            import json

            from builder.spec.schema import json_schema

            print(json.dumps(json_schema(), indent=2))
            return 0
        if args.command == "engines":
            specs = load_manifest(args.manifest)
            if args.only:
                unknown = sorted(set(args.only) - {s.name for s in specs})
                if unknown:
                    raise ManifestError(f"--only {', '.join(unknown)}: not in {args.manifest} "
                                        f"(models: {', '.join(s.name for s in specs)})")
                specs = [s for s in specs if s.name in args.only]
            return _build(args, specs)
        if args.command == "build":
            # The flags become the [[model]] table they stand for, checked as models.toml's are.
            flags = BuildFlags(**{f.name: getattr(args, f.name) for f in fields(BuildFlags)})
            return _build(args, [spec_from_flags(flags)])
        if args.command == "serve":
            return _serve(args)
        if args.command == "tune":
            return _tune(args)
        if args.command == "verify":
            return _verify(args)
        if args.command == "stop":
            from builder.serving.triton_server import stop_recorded

            # Signals only the recorded pid, and only while it is this state folder's tritonserver.
            result = stop_recorded(args.state_dir)
            if result.pid is not None:
                print(f"tritonserver stopped (pid {result.pid})")
            elif result.exited is not None:
                print(f"no tritonserver was running (recorded pid {result.exited} had exited)")
            else:
                print("no tritonserver was running")
            return 0
    except BuilderError as exc:
        # A message may hold several errors (every mistake of a models.toml): one prefixed line each.
        for line in str(exc).splitlines() or [""]:
            print(f"trtbuild: error: {line}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("trtbuild: interrupted", file=sys.stderr)
        return 130
    finally:
        progress.configure(progress.Mode.OFF)
        close_log_file()
    return 2


if __name__ == "__main__":
    sys.exit(main())
