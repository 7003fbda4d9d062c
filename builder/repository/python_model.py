"""Triton python-backend model: runs the ONNX file beside it with ONNX Runtime, on the CPU or on a GPU
through the CUDA provider.

Copied into each model version folder as `model.py` by the repository writer, so it is one file that
imports nothing of ours. Requests that arrive together (dynamic batching) and share non-batch shapes
run as one batch.

On a GPU (config parameter `provider: cuda`), one ONNX Runtime session per batch-size bucket: the
CUDA provider's Conv kernels keep only the last input shape's cuDNN state and rebuild it whenever the
shape changes (seconds per run in FP16, measured), and consecutive batches under dynamic batching
differ in size. A batch is padded up to the next bucket, so each session only ever sees one shape.
Each bucket has its input and output tensors preallocated on the device (IO binding), page-locked
host staging buffers where cuda-python is importable, and, where every node runs on the CUDA
provider, a CUDA graph captured once at load. Inputs that a client sent through CUDA shared memory
arrive as device tensors (the config sets FORCE_CPU_ONLY_INPUT_TENSORS no) and are copied on the GPU
straight into the bucket's bound input, so no byte of them crosses host memory.
"""

# mypy: ignore-errors
from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import random
import re
import time
import weakref

import numpy as np
import onnxruntime as ort

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported outside Triton (tests, benchmarks): the runner classes only
    pb_utils = None

log = logging.getLogger(__name__)

_NUMPY_OF_ORT = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8, "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


# ONNX Runtime's words when device or host memory runs out (its CUDA arena, CUDA, cuDNN, the C++ allocator).
_OUT_OF_MEMORY = re.compile(r"out of memory|failed to allocate memory|available memory of \d+ is smaller than "
                            r"requested|bad_alloc|ALLOC_FAILED|cudaErrorMemoryAllocation", re.IGNORECASE)


def out_of_memory(exc):
    """Whether `exc` says memory ran out: Python's MemoryError, or ONNX Runtime's failure to allocate."""
    return isinstance(exc, MemoryError) or bool(_OUT_OF_MEMORY.search(str(exc)))


def _reason(exc):
    """An error's text for a client; an out-of-memory failure says so (a MemoryError's own text is empty)."""
    if out_of_memory(exc):
        return f"out of memory ({str(exc).strip() or type(exc).__name__})"
    return str(exc)


def buckets(max_batch: int, fine: bool = False) -> list[int]:
    """Powers of two below max_batch, and max_batch itself: padding wastes under half a batch. `fine`: powers of
    two below a step (the power of two at or above max_batch / 8, at least 8), then every multiple of the step
    (at most 8 of them): a batch of 50 runs in 56, not 64
    (H200, FP16 EfficientNet-Lite0, max batch 64, 5 rounds of one machine start, each beside the default:
    0.99-1.05x its rate at concurrency 256, 2-6 % fewer joules per inference), for more sessions (11 instead of 7)
    and more device memory (their batch sizes add up to 295 rows of activations instead of 127)."""
    max_batch = max(max_batch, 1)
    # A power of two, so every power of two up to it stays a bucket: no batch pads more than under `pow2`.
    step = max(8, 1 << (-(-max_batch // 8) - 1).bit_length()) if fine else max_batch
    sizes, b = [], 1
    while b < min(step, max_batch):
        sizes.append(b)
        b *= 2
    sizes += range(step, max_batch, step)  # empty for pow2, where the step is max_batch
    return [*sizes, max_batch]


def parse_buckets(text, max_batch):
    """The config parameter `batch_buckets`: `pow2` (also empty or `auto`: buckets(max_batch)), `fine`
    (buckets(max_batch, fine=True)) or comma-separated batch sizes, each 1..max_batch (max_batch is added where
    missing, so every batch Triton forms has a bucket)."""
    text = (text or "").strip()
    if text in ("", "auto", "pow2"):
        return buckets(max_batch)
    if text == "fine":
        return buckets(max_batch, fine=True)
    sizes = set()
    for part in text.split(","):
        try:
            size = int(part.strip())
        except ValueError:
            raise ValueError(f"parameter batch_buckets {text!r}: {part.strip()!r} is not a whole number "
                             "(expected pow2, fine or batch sizes)") from None
        if not 1 <= size <= max_batch:
            raise ValueError(f"parameter batch_buckets {text!r}: {size} is outside 1..max_batch_size ({max_batch})")
        sizes.add(size)
    return sorted(sizes | {max_batch})


# The runner's phase timers (config parameter `runner_timers`: a folder). Each phase is the wall time from the
# previous mark to its own, summed over one execute() call; see PhaseTimer and docs/gpu.md.
PHASES = ("read_inputs", "gather", "h2d", "d2d_wait", "run", "d2h", "respond")
TIMERS_FORMAT = "trtbuild-runner-timers/1"


class PhaseTimer:
    """Per-phase wall time of each execute() call (time.perf_counter_ns), kept in memory as counts, sums,
    request-weighted sums (each execute's time counted once per request in it, as Triton's per-request
    statistics count a batch's time) and percentiles from a bounded reservoir of executes; written as JSON to
    `<folder>/<instance>.<pid>.json` every `period_s` (checked when an execute ends, so a killed server leaves
    figures at most one period old) and at finalize, with one line per period appended to
    `<instance>.<pid>.intervals.jsonl` (that period's sums, bounded by monotonic-clock stamps a client on the
    same host can compare with its own measurement windows).

    start() opens an execute, mark(phase) adds the time since the previous mark (or the start) to `phase`,
    end() closes it; so the phases of one execute never sum to more than its own wall time.

    With `batches` > 0 each execute is also one line of `<instance>.<pid>.batches.jsonl` (its monotonic start,
    wall time, run phase, requests and rows; at most `batches` per period and instance, the rest counted as
    dropped, per period in the intervals file), so a reader can group batches by their rows and by the other
    instances' batches running at the same time (their lines share the clock). A bench diagnostic: the file
    grows with the run.

    A periodic write that fails (a full disk, a removed folder) stops the timers' files with one log line; the
    requests are served as before."""

    def __init__(self, folder, *, model, instance, period_s=1.0, reservoir=1024, extra=None, batches=0):
        self.folder = folder
        os.makedirs(folder, exist_ok=True)
        base = os.path.join(folder, f"{instance}.{os.getpid()}")
        self.path, self.intervals_path = base + ".json", base + ".intervals.jsonl"
        self.batches_path = base + ".batches.jsonl"
        self.batch_cap, self.batch_lines, self.batches_dropped = batches, [], 0
        self.write_failed = None  # why the timers stopped writing, once a write failed
        self.head = {"format": TIMERS_FORMAT, "model": model, "instance": instance, "pid": os.getpid(),
                     "period_s": period_s, "phases": list(PHASES), **(extra or {})}
        self.period_ns = int(period_s * 1e9)
        self.index = {name: i for i, name in enumerate(PHASES)}
        n = len(PHASES) + 1  # the phases, then the execute's own wall time
        self.executes = self.requests = self.rows = 0
        self.sums, self.weighted, self.seen, self.maxima = [0] * n, [0] * n, [0] * n, [0] * n
        self.samples, self.capacity, self.rng = [], reservoir, random.Random(0)
        self.writes, self.write_ns = 0, 0
        self._open_interval()
        self.last_write = time.perf_counter_ns()
        self.current, self.t0, self.t, self.mono0 = [0] * len(PHASES), 0, 0, 0
        self.write()  # the file exists from the load on: a reader can tell timers that ran from timers off

    def _open_interval(self):
        self.interval = {"first_ns": None, "last_ns": None, "executes": 0, "requests": 0, "rows": 0,
                         "sums": [0] * (len(PHASES) + 1), "weighted": [0] * (len(PHASES) + 1), "dropped": 0}

    def start(self):
        self.mono0 = time.monotonic_ns()
        self.t0 = self.t = time.perf_counter_ns()
        self.current = [0] * len(PHASES)

    def mark(self, phase):
        now = time.perf_counter_ns()
        self.current[self.index[phase]] += now - self.t
        self.t = now

    def end(self, requests, rows):
        """Closes the execute opened by start(); writes the files once a period has passed."""
        now = time.perf_counter_ns()
        values = [*self.current, now - self.t0]
        self.executes += 1
        self.requests += requests
        self.rows += rows
        iv = self.interval
        if iv["first_ns"] is None:
            iv["first_ns"] = self.mono0
        iv["last_ns"] = self.mono0 + (now - self.t0)
        iv["executes"] += 1
        iv["requests"] += requests
        iv["rows"] += rows
        for i, v in enumerate(values):
            if v:
                self.seen[i] += 1
                self.sums[i] += v
                self.weighted[i] += v * requests
                iv["sums"][i] += v
                iv["weighted"][i] += v * requests
                if v > self.maxima[i]:
                    self.maxima[i] = v
        if self.batch_cap:
            if len(self.batch_lines) < self.batch_cap:
                self.batch_lines.append((self.mono0, values[-1], self.current[self.index["run"]], requests, rows))
            else:
                self.batches_dropped += 1
                iv["dropped"] += 1
        if len(self.samples) < self.capacity:  # reservoir sampling (algorithm R): each execute equally likely kept
            self.samples.append(values)
        else:
            j = self.rng.randrange(self.executes)
            if j < self.capacity:
                self.samples[j] = values
        if now - self.last_write >= self.period_ns and self.write_failed is None:
            try:
                self.write()
            except OSError as exc:  # the timers' files, not the requests: serving goes on without them
                self.write_failed = str(exc)
                log.warning("runner timers: writing to %s failed (%s); no more timer files from this instance",
                            self.folder, exc)

    def _stats(self, i):
        kept = sorted(s[i] for s in self.samples if s[i])

        def pct(q):
            return round(kept[min(len(kept) - 1, int(q * len(kept)))] / 1e3, 1) if kept else None

        return {"count": self.seen[i], "sum_ns": self.sums[i], "weighted_sum_ns": self.weighted[i],
                "p50_us": pct(0.50), "p90_us": pct(0.90), "p99_us": pct(0.99),
                "max_us": round(self.maxima[i] / 1e3, 1) if self.seen[i] else None}

    def summary(self, *, final=False):
        return {**self.head, "final": final, "written_monotonic_ns": time.monotonic_ns(),
                "intervals_file": os.path.basename(self.intervals_path),
                **({"batches_file": os.path.basename(self.batches_path), "batches_dropped": self.batches_dropped}
                   if self.batch_cap else {}),
                "executes": self.executes, "requests": self.requests, "rows": self.rows,
                "execute": self._stats(len(PHASES)),
                "phases": {name: self._stats(i) for i, name in enumerate(PHASES)},
                "timer_writes": {"count": self.writes, "sum_ns": self.write_ns}}

    def write(self, *, final=False):
        """The summary (atomically: a reader never sees half a file) and the open period's line."""
        started = time.perf_counter_ns()
        iv = self.interval
        if iv["executes"]:
            line = {"first_ns": iv["first_ns"], "last_ns": iv["last_ns"], "executes": iv["executes"],
                    "requests": iv["requests"], "rows": iv["rows"], "execute_ns": iv["sums"][-1],
                    "execute_weighted_ns": iv["weighted"][-1],
                    "phases_ns": dict(zip(PHASES, iv["sums"][:-1], strict=True)),
                    "phases_weighted_ns": dict(zip(PHASES, iv["weighted"][:-1], strict=True)),
                    **({"batches_dropped": iv["dropped"]} if self.batch_cap else {})}
            with open(self.intervals_path, "a") as handle:
                handle.write(json.dumps(line) + "\n")
            self._open_interval()
        if self.batch_lines:
            with open(self.batches_path, "a") as handle:
                handle.writelines(f'{{"start_ns": {b[0]}, "execute_ns": {b[1]}, "run_ns": {b[2]}, '
                                  f'"requests": {b[3]}, "rows": {b[4]}}}\n' for b in self.batch_lines)
            self.batch_lines = []
        self.writes += 1
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as handle:
            json.dump(self.summary(final=final), handle, indent=1)
        os.replace(tmp, self.path)
        self.last_write = time.perf_counter_ns()
        self.write_ns += self.last_write - started


def make_timer(params, args, extra=None):
    """The instance's PhaseTimer where the config's parameter `runner_timers` names a folder, else None (no
    timer code runs then: each phase boundary is one `is not None` test)."""
    folder = (params.get("runner_timers") or "").strip()
    if not folder:
        return None
    period = float(params.get("runner_timers_period_s", "") or 1.0)
    if not period > 0:
        raise ValueError(f"parameter runner_timers_period_s {period}: expected a number of seconds > 0")
    batches = (params.get("runner_timers_batches") or "").strip() or "0"
    if not re.fullmatch(r"[0-9]+", batches):
        raise ValueError(f"parameter runner_timers_batches {batches!r}: expected a whole number of batches per "
                         "period (0: none)")
    model = args.get("model_name", "model")
    instance = args.get("model_instance_name") or model
    return PhaseTimer(folder, model=model, instance=instance, period_s=period, extra=extra, batches=int(batches))


class CpuRunner:
    """One CPU session; any batch size runs as it comes."""

    provider = "cpu"
    timer = None  # a PhaseTimer where the model config turns the runner's timers on

    def __init__(self, path, *, intra_op_threads=0):
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if intra_op_threads:
            options.intra_op_num_threads = intra_op_threads
        self.session = ort.InferenceSession(path, sess_options=options, providers=["CPUExecutionProvider"])
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run(self, feed):
        return self.session.run(self.output_names, feed)

    def run_many(self, feeds):
        feeds = [host_feed(f) for f in feeds]
        batch = {n: np.concatenate([f[n] for f in feeds]) for n in feeds[0]}
        if self.timer is not None:
            self.timer.mark("gather")
        produced = self.run(batch)
        if self.timer is not None:
            self.timer.mark("run")
        return produced

    def describe(self):
        return {"provider": "cpu"}


def _pin(array, device_id=0):
    """Page-lock a numpy buffer so host-to-device copies from it are DMA at full speed; False where
    cuda-python is missing or the call fails (the copy then goes through a pageable bounce)."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return False
    # The instance's own GPU first: a stub's first runtime call otherwise opens a context on GPU 0, which
    # on a host of several GPUs costs every stub of another GPU that context's memory on GPU 0.
    (err,) = cudart.cudaSetDevice(device_id)
    if err != cudart.cudaError_t.cudaSuccess:
        return False
    (err,) = cudart.cudaHostRegister(array.ctypes.data, array.nbytes, cudart.cudaHostRegisterDefault)
    if err != cudart.cudaError_t.cudaSuccess:
        return False
    # Unregister before numpy frees the buffer: a stale registration makes later copies from memory
    # reusing that address fail ("invalid argument"), seen when a second runner loaded.
    weakref.finalize(array, cudart.cudaHostUnregister, array.ctypes.data)
    return True


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):  # DLManagedTensor starts with it (DLPack < 1.0, what the backend exports)
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_DL_CUDA, _DL_CUDA_MANAGED = 2, 13
_NUMPY_OF_DL = {(2, 32): np.float32, (2, 16): np.float16, (2, 64): np.float64, (0, 64): np.int64,
                (0, 32): np.int32, (0, 8): np.int8, (1, 8): np.uint8, (6, 8): np.bool_}


class DeviceInput:
    """A request's input that lives on the GPU: its address, shape and dtype read from the DLPack capsule
    the python backend exports (`Tensor.to_dlpack()`), which it keeps alive while the batch runs."""

    devices = (_DL_CUDA, _DL_CUDA_MANAGED)

    def __init__(self, capsule, owner=None):
        self._keep = (capsule, owner)
        view = ctypes.cast(_capsule_pointer(capsule, b"dltensor"), ctypes.POINTER(_DLTensor)).contents
        if view.device.device_type not in self.devices:
            raise ValueError(f"DLPack device type {view.device.device_type} is not a CUDA device")
        key = (view.dtype.code, view.dtype.bits)
        if key not in _NUMPY_OF_DL or view.dtype.lanes != 1:
            raise ValueError(f"DLPack dtype code {view.dtype.code}, {view.dtype.bits} bits is not supported")
        self.dtype = np.dtype(_NUMPY_OF_DL[key])
        self.shape = tuple(int(view.shape[i]) for i in range(view.ndim))
        if view.strides:  # NULL strides mean row-major; anything else must be row-major too
            step = 1  # in elements; a dim of size 1 may carry any stride (as the python backend's own check)
            for i in reversed(range(view.ndim)):
                if self.shape[i] != 1 and int(view.strides[i]) != step:
                    raise ValueError(f"a non-contiguous device tensor (shape {self.shape}) is not supported")
                step *= self.shape[i]
        self.ptr = int(view.data or 0) + int(view.byte_offset)
        self.device_id = int(view.device.device_id)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def __len__(self):
        return self.shape[0] if self.shape else 1

    def numpy(self):
        """A host copy, for runners that take numpy arrays (CPU, one plain CUDA session)."""
        out = np.empty(self.shape, dtype=self.dtype)
        _set_device(_cudart(), self.device_id)  # the tensor's GPU, not a context opened on GPU 0
        _memcpy(out.ctypes.data, self.ptr, self.nbytes)
        return out


def _cudart():
    """cuda-python's runtime module; without it an input that arrived in GPU memory cannot be read: one line
    saying so (the request gets it as its error) instead of a bare ImportError."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart  # cuda-python 12 before 12.6
        except ImportError as exc:
            raise RuntimeError("an input arrived in GPU memory (CUDA shared memory) and reading it needs cuda-python "
                               f"in the server's Python (pip install cuda-python): {exc}") from None
    return cudart


def _set_device(rt, device_id):
    (err,) = rt.cudaSetDevice(device_id)
    if err != rt.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaSetDevice({device_id}): {err}")


def _memcpy(dst, src, nbytes, *, stream=0, sync=True):
    """cudaMemcpyAsync with the direction taken from the addresses (unified addressing), on the legacy
    default stream; `sync` waits for it. ONNX Runtime runs on its own stream afterwards, so the
    copies into a bound input must be complete before the run starts."""
    rt = _cudart()
    (err,) = rt.cudaMemcpyAsync(dst, src, nbytes, rt.cudaMemcpyKind.cudaMemcpyDefault, stream)
    if err != rt.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaMemcpyAsync of {nbytes} bytes: {err}")
    if sync:
        _synchronize(stream)


def _synchronize(stream=0):
    rt = _cudart()
    (err,) = rt.cudaStreamSynchronize(stream)
    if err != rt.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaStreamSynchronize: {err}")


def host_feed(feed):
    """`feed` with every device input copied to a numpy array."""
    return {n: v.numpy() if isinstance(v, DeviceInput) else v for n, v in feed.items()}


class DynamicDims(ValueError):
    """An input or output has a dynamic dim besides the batch (a text model's sequence length): a bucket
    has no one shape to preallocate."""


class NoCudaProvider(RuntimeError):
    """ONNX Runtime did not start its CUDA provider for a bucket (whose device tensors need it)."""


def _cuda_session(path, options, provider_options):
    """A session on the CUDA provider. Where the provider does not start, ONNX Runtime falls back to the CPU
    without a word: the session it fell back to, made once more with its warnings on (they say why, in
    Triton's log); the caller decides whether that may run (`_no_cuda`)."""

    def make():
        return ort.InferenceSession(path, sess_options=options,
                                    providers=[("CUDAExecutionProvider", provider_options), "CPUExecutionProvider"])

    # onnxruntime-gpu 1.31 warns on its process-wide logger, once per CUDA session given provider options, that
    # no plugin EP device is registered: one line per bucket and instance in Triton's log. The logger has no
    # getter, so it goes back to ONNX Runtime's default (2, warnings) afterwards.
    ort.set_default_logger_severity(3)
    try:
        session = make()
    finally:
        ort.set_default_logger_severity(2)
    if "CUDAExecutionProvider" not in session.get_providers():
        session = make()
    return session


def _no_cuda(path, session):
    """Why `session` is not on the CUDA provider, or None where it is."""
    if "CUDAExecutionProvider" in session.get_providers():
        return None
    return (f"{path}: ONNX Runtime did not start its CUDA provider (CUDA or cuDNN libraries missing?); its warnings "
            "above say why")


class _Bucket:
    """One batch size: its session, device tensors bound once, host staging buffers."""

    def __init__(self, path, size, *, provider_options, cuda_graph, device_id, pin=True):
        self.size = size
        self.device_id = device_id
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        provider = dict(provider_options)
        if cuda_graph:
            provider["enable_cuda_graph"] = "1"
        self.session = _cuda_session(path, options, provider)
        self.cuda_graph = cuda_graph
        self.binding = self.session.io_binding()
        self.inputs, self.host, self.outputs = {}, {}, {}
        self.pinned = True
        for kind, nodes in (("input", self.session.get_inputs()), ("output", self.session.get_outputs())):
            for node in nodes:
                if not all(isinstance(d, int) and d > 0 for d in [size, *node.shape[1:]]):
                    raise DynamicDims(f"{kind} {node.name} has dynamic non-batch dims {node.shape}")
        # After the shapes (a model whose shapes vary gets one plain session, which may run on the CPU): the
        # device tensors bound below need the CUDA provider.
        if (why := _no_cuda(path, self.session)) is not None:
            raise NoCudaProvider(why)
        for node in self.session.get_inputs():
            shape = [size, *node.shape[1:]]
            dtype = _NUMPY_OF_ORT[node.type]
            self.host[node.name] = np.zeros(shape, dtype=dtype)
            self.pinned = pin and _pin(self.host[node.name], device_id) and self.pinned
            self.inputs[node.name] = ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, "cuda", device_id)
            self.inputs[node.name].update_inplace(self.host[node.name])
            self.binding.bind_ortvalue_input(node.name, self.inputs[node.name])
        self.output_names = [o.name for o in self.session.get_outputs()]
        for node in self.session.get_outputs():
            shape = [size, *node.shape[1:]]
            value = ort.OrtValue.ortvalue_from_shape_and_type(shape, _NUMPY_OF_ORT[node.type], "cuda", device_id)
            self.outputs[node.name] = value
            self.binding.bind_ortvalue_output(node.name, value)

    def run(self, feed, rows):
        return self.run_parts([feed], rows)

    def run_parts(self, feeds, rows, timer=None):
        """Requests' inputs concatenated straight into the staging buffer (one host copy, not two); inputs
        already on the GPU are copied device to device into the bound input at their row offset. `timer`: the
        phases gather, h2d (or d2d_wait), run and d2h are marked on it."""
        for name, host in self.host.items():
            parts = [f[name] for f in feeds]
            if any(isinstance(p, DeviceInput) for p in parts):
                self._gather_on_device(name, parts, host, timer)
                continue
            if len(feeds) == 1:
                host[:rows] = parts[0]
            else:
                np.concatenate(parts, out=host[:rows])
            if timer is not None:
                timer.mark("gather")
            self.inputs[name].update_inplace(host)  # a blocking host-to-device copy of the whole bucket
            if timer is not None:
                timer.mark("h2d")
        self.session.run_with_iobinding(self.binding)  # ONNX Runtime waits for the device before it returns
        if timer is not None:
            timer.mark("run")
        produced = [self.outputs[name].numpy()[:rows] for name in self.output_names]  # blocking copies to host
        if timer is not None:
            timer.mark("d2h")
        return produced

    def _gather_on_device(self, name, parts, host, timer=None):
        """Each request's rows into the bound device input in order: GPU parts by a device-to-device copy,
        host parts through the staging buffer; one synchronization for them all (`timer`: the copies' issue
        is marked gather, the wait for them d2d_wait)."""
        _set_device(_cudart(), self.device_id)  # the stub's thread may be on another device
        base, offset, row = self.inputs[name].data_ptr(), 0, 0
        row_bytes = host[0].nbytes
        for part in parts:
            n = len(part)
            if isinstance(part, DeviceInput):
                if part.dtype != host.dtype:  # the bytes would be copied as they are, never converted
                    raise ValueError(f"input {name}: a device tensor of {part.dtype} where the model takes "
                                     f"{host.dtype}")
                if part.nbytes != n * row_bytes:
                    raise ValueError(f"input {name}: a device tensor of shape {part.shape} does not fit rows of "
                                     f"{host.shape[1:]} {host.dtype}")
                _memcpy(base + offset, part.ptr, part.nbytes, sync=False)
            else:
                host[row : row + n] = part
                _memcpy(base + offset, host[row : row + n].ctypes.data, n * row_bytes, sync=False)
            offset += n * row_bytes
            row += n
        if timer is not None:
            timer.mark("gather")
        _synchronize()
        if timer is not None:
            timer.mark("d2d_wait")


class CudaBucketRunner:
    """One CUDA session per bucket size, each seeing one shape; see the module docstring."""

    provider = "cuda"
    timer = None  # a PhaseTimer where the model config turns the runner's timers on

    def __init__(self, path, *, max_batch, provider_options, cuda_graphs=True, warmup_runs=2, sizes=None, pin=True):
        self.provider_options = {k: str(v) for k, v in provider_options.items()}
        device_id = int(self.provider_options.get("device_id", "0"))
        if hasattr(ort, "preload_dlls"):
            ort.preload_dlls()  # CUDA/cuDNN from the nvidia-* pip packages, where they are installed
        self.sizes = sorted(sizes) if sizes else buckets(max_batch)  # sizes: benchmarks measure a few
        self.buckets = {}
        self.graph_fallback = None
        started = time.perf_counter()
        for size in self.sizes:
            bucket = None
            if cuda_graphs and self.graph_fallback is None:
                try:
                    bucket = _Bucket(path, size, provider_options=self.provider_options, cuda_graph=True,
                                     device_id=device_id, pin=pin)
                    for _ in range(max(warmup_runs, 2)):  # the first graph run captures
                        bucket.run(bucket.host, size)
                except (DynamicDims, NoCudaProvider):
                    raise  # no bucket can be preallocated, with or without a graph
                except MemoryError:
                    raise  # the model does not fit: no second session on a full device
                except Exception as exc:  # ORT refuses graphs when a node is off the GPU
                    if out_of_memory(exc):  # as above: the model does not fit
                        raise
                    self.graph_fallback = str(exc).strip().splitlines()[-1][:300]
                    log.warning("CUDA graphs off: %s", self.graph_fallback)
                    bucket = None
                    gc.collect()  # free the refused session's device memory before the next one
            if bucket is None:
                bucket = _Bucket(path, size, provider_options=self.provider_options, cuda_graph=False,
                                 device_id=device_id, pin=pin)
                for _ in range(warmup_runs):
                    bucket.run(bucket.host, size)
            self.buckets[size] = bucket
        self.load_seconds = time.perf_counter() - started
        self.output_names = self.buckets[self.sizes[0]].output_names
        self.input_names = list(self.buckets[self.sizes[0]].host)

    def bucket_for(self, rows):
        return next(s for s in self.sizes if s >= rows)

    def run(self, feed):
        rows = len(next(iter(feed.values())))
        largest = self.sizes[-1]
        parts = []
        for start in range(0, rows, largest):  # more rows than the largest bucket: run in chunks
            chunk = {k: v[start : start + largest] for k, v in feed.items()}
            n = min(largest, rows - start)
            parts.append(self.buckets[self.bucket_for(n)].run(chunk, n))
        if len(parts) == 1:
            return parts[0]
        return [np.concatenate([p[i] for p in parts]) for i in range(len(self.output_names))]

    def run_many(self, feeds):
        rows = sum(len(f[self.input_names[0]]) for f in feeds)
        if rows <= self.sizes[-1]:
            return self.buckets[self.bucket_for(rows)].run_parts(feeds, rows, self.timer)
        feeds = [host_feed(f) for f in feeds]  # more rows than any bucket: run in chunks from the host
        batch = {n: np.concatenate([f[n] for f in feeds]) for n in self.input_names}
        if self.timer is not None:
            self.timer.mark("gather")
        produced = self.run(batch)  # the chunks' copies are inside this run phase
        if self.timer is not None:
            self.timer.mark("run")
        return produced

    def describe(self):
        first = self.buckets[self.sizes[0]]
        return {"provider": "cuda", "provider_options": self.provider_options, "buckets": self.sizes,
                "cuda_graphs": all(b.cuda_graph for b in self.buckets.values()),
                "cuda_graphs_off_reason": self.graph_fallback, "pinned_host_buffers": first.pinned,
                "load_seconds": round(self.load_seconds, 2)}


class CudaPlainRunner(CpuRunner):
    """One CUDA session, no buckets: a model without a batch axis, or one whose other dims vary (`reason`)."""

    provider = "cuda"

    def __init__(self, path, *, provider_options, reason=None):
        self.reason = reason
        if hasattr(ort, "preload_dlls"):
            ort.preload_dlls()
        self.provider_options = {k: str(v) for k, v in provider_options.items()}
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = _cuda_session(path, options, self.provider_options)
        self.no_cuda = _no_cuda(path, self.session)
        if self.no_cuda is not None:  # one plain session runs either way
            log.warning("%s; this model runs on the CPU", self.no_cuda)
        self.output_names = [o.name for o in self.session.get_outputs()]

    def describe(self):
        return {"provider": "cuda" if self.no_cuda is None else "cpu (the CUDA provider did not start)",
                "provider_options": self.provider_options, "buckets": None, "buckets_off_reason": self.reason}


def _subgraphs(nodes):
    """Every graph these nodes hold in their attributes (If branches, Loop and Scan bodies), at any depth."""
    import onnx

    for node in nodes:
        for a in node.attribute:
            for sub in [a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs:
                yield sub
                yield from _subgraphs(sub.node)


def _elem_types(t):
    """The element types a value's type names (tensors, and those inside sequences, optionals and maps)."""
    kind = t.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        yield getattr(t, kind).elem_type
    elif kind in ("sequence_type", "optional_type"):
        yield from _elem_types(getattr(t, kind).elem_type)
    elif kind == "map_type":
        yield from _elem_types(t.map_type.value_type)


# Where the NHWC layout pays (on tensor cores); FusedConv is ONNX Runtime's own (com.microsoft), as an
# optimized graph a user brings may hold it. Any one of them turns NHWC's `auto` on: a graph that is mostly
# attention with one patch-embedding Conv gets NHWC too (not measured).
CONVOLUTIONS = ("Conv", "ConvTranspose", "FusedConv")


def _graph_facts(path):
    """(kind, convolutions) from one parse of the graph (subgraphs and local functions count; the weights are
    not loaded). kind: 'qdq' (INT8), 'fp16' or 'fp32'. convolutions: whether any node is one; NHWC on a graph
    with none is all cost (served on an H200, MiniLM FP16 in NHWC ran 0.25x its rate in NCHW: ONNX Runtime added
    50 host-device copies for it; bench/gpu/results/2026-11-29-h200-minilm-layout-served.txt).
    builder.runtimes.onnxruntime_cuda calls this one for the build's accuracy run and the config."""
    import onnx

    model = onnx.load(path, load_external_data=False)
    function_nodes = [n for f in model.functions for n in f.node]
    graphs = [model.graph, *_subgraphs(model.graph.node), *_subgraphs(function_nodes)]
    nodes = [n for g in graphs for n in g.node] + function_nodes
    return _kind(onnx, graphs, nodes), any(n.op_type in CONVOLUTIONS for n in nodes)


def _kind(onnx, graphs, nodes):
    if any(node.op_type in ("QuantizeLinear", "DequantizeLinear") for node in nodes):
        return "qdq"
    fp16 = onnx.TensorProto.FLOAT16
    tensors = [t for g in graphs for t in g.initializer] + [t.values for g in graphs for t in g.sparse_initializer]
    for node in nodes:
        for a in node.attribute:
            tensors += [a.t] if a.type == onnx.AttributeProto.TENSOR else list(a.tensors)
            tensors += [a.sparse_tensor.values] if a.type == onnx.AttributeProto.SPARSE_TENSOR else []
            if a.type == onnx.AttributeProto.INT and a.i == fp16 and (
                    a.name == "dtype" or (node.op_type == "Cast" and a.name == "to")):
                return "fp16"
    if any(t.data_type == fp16 for t in tensors):
        return "fp16"
    values = [v for g in graphs for v in (*g.input, *g.output, *g.value_info)]
    if any(e == fp16 for v in values for e in _elem_types(v.type)):
        return "fp16"
    return "fp32"


def _graph_kind(path):
    """'qdq' (INT8), 'fp16' or 'fp32' (see _graph_facts)."""
    return _graph_facts(path)[0]


def _has_qdq(path):
    return _graph_kind(path) == "qdq"


GRAPH_KINDS = ("qdq", "fp16", "fp32")  # what _graph_kind answers, and the config parameter graph_kind holds


def _resolve_auto(path, options, kind=None, convolutions=None):
    """`use_tf32` and `prefer_nhwc` left at auto, resolved for this graph as builder.runtimes.onnxruntime_cuda's
    CudaOptions.provider_options resolves them for the build's accuracy run (tests/builder/runtimes/
    test_graph_kind.py compares both). No TF32 for FP32 graphs (TF32 put the FP32 variant outside its accuracy
    gate); NHWC only where the convolutions run on tensor cores, FP16 or FP32 with TF32 (H200, batch 64: 1.2x
    and 1.26x; FP32 without TF32 0.95x at 9 % more J; the INT8 Q/DQ graph 0.52x). `kind`: the graph's kind as
    the build found it; None: read the graph here, which every instance does at every load (a graph with
    200 MB of weights inside took 0.28 s to parse on a 2-core CPU). `convolutions`: whether the graph has any,
    as the build found it (None: read the graph where it matters)."""
    options = dict(options)
    read = []  # the graph's facts, parsed once where a fact the config lacks is needed

    def facts():
        if not read:
            read.append(_graph_facts(path))
        return read[0]

    if options.get("use_tf32", "auto") == "auto":
        kind = kind or facts()[0]
        options["use_tf32"] = "0" if kind == "fp32" else "1"
    if options.get("prefer_nhwc", "auto") == "auto":
        kind = kind or facts()[0]
        tensor_cores = kind == "fp16" or (kind == "fp32" and options["use_tf32"] != "0")
        if tensor_cores and convolutions is None:
            convolutions = facts()[1]
        options["prefer_nhwc"] = "1" if tensor_cores and convolutions else "0"
    return options


# CUDA provider options a model config may set as parameters of the same name (measured choices).
PROVIDER_PASSTHROUGH = ("prefer_nhwc", "use_tf32", "cudnn_conv_use_max_workspace")


def _built_kind(params):
    """The graph's kind as the build wrote it (parameter `graph_kind`); None where a repository built before
    the parameter existed has none, or holds a value this runner does not know: the graph is read instead."""
    kind = params.get("graph_kind") or None
    if kind is not None and kind not in GRAPH_KINDS:
        log.warning("parameter graph_kind %r: expected one of %s; reading the graph instead", kind,
                    ", ".join(GRAPH_KINDS))
        return None
    return kind


def make_runner(path, params, max_batch):
    """The runner the model config's parameters ask for (`provider`: cpu, the default, or cuda)."""
    provider = params.get("provider", "cpu") or "cpu"
    if provider == "cpu":
        return CpuRunner(path, intra_op_threads=int(params.get("intra_op_threads", "0") or 0))
    if provider != "cuda":
        raise ValueError(f"parameter provider {provider!r}: expected cpu or cuda")
    # kSameAsRequested: one session per bucket, so no arena should round its blocks up to powers of two.
    options = {"device_id": params.get("device_id", "0"),
               "cudnn_conv_algo_search": params.get("cudnn_conv_algo_search", "HEURISTIC"),
               "arena_extend_strategy": "kSameAsRequested"}
    options |= {k: params[k] for k in PROVIDER_PASSTHROUGH if params.get(k)}
    built = params.get("graph_convolutions")  # absent in a repository built before the parameter existed
    options = _resolve_auto(path, options, _built_kind(params), {"1": True, "0": False}.get(built))
    if max_batch <= 0:  # no batch axis: one session, the shapes the clients send
        return CudaPlainRunner(path, provider_options=options)
    try:
        return CudaBucketRunner(path, max_batch=max(max_batch, 1), provider_options=options,
                                cuda_graphs=params.get("cuda_graphs", "1") == "1",
                                sizes=parse_buckets(params.get("batch_buckets"), max_batch))
    except DynamicDims as exc:
        # A text model's sequence length, say: the clients' shapes vary beyond the batch, so one session
        # takes them as they come (a shape change may cost it a re-plan, as on the CPU path).
        log.warning("batch buckets off: %s; one CUDA session", exc)
        gc.collect()  # the refused bucket's session and device memory, before the next session
        return CudaPlainRunner(path, provider_options=options, reason=str(exc))


def _input(tensor):
    """A request's input as numpy (host memory) or, where the backend hands it over on the GPU, as a
    DeviceInput; only the bucket runner copies those on the device, the others take a host copy."""
    if tensor.is_cpu():
        return tensor.as_numpy()
    _cudart()  # every runner reads device inputs through it: without it, this request alone is refused
    return DeviceInput(tensor.to_dlpack(), tensor)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        path = os.path.join(args["model_repository"], args["model_version"], params.get("onnx_file", "model.onnx"))
        if args.get("model_instance_kind") == "GPU":  # each GPU instance runs on the device Triton gave it
            params["device_id"] = str(args.get("model_instance_device_id", "0"))
        self.runner = make_runner(path, params, int(config.get("max_batch_size", 0)))
        self.batching = int(config.get("max_batch_size", 0)) > 0  # 0: each request is one whole input
        # Triton has no scalar tensors without batching: config.pbtxt declares them [1]; the graph wants [].
        self.scalars = {n for n in params.get("scalar_inputs", "").split(",") if n}
        self.input_names = [i["name"] for i in config["input"]]
        self.output_names = [o["name"] for o in config["output"]]
        self.order = [self.runner.output_names.index(n) for n in self.output_names]
        pb_utils.Logger.log_info(f"{args['model_name']}: {json.dumps(self.runner.describe())}")
        self.timer = make_timer(params, args, {"runner": self.runner.describe()})
        self.runner.timer = self.timer  # the runner marks its own phases on it (None: timers off)
        if self.timer is not None:
            pb_utils.Logger.log_info(f"{args['model_name']}: runner timers to {self.timer.path}")
        if params.get("FORCE_CPU_ONLY_INPUT_TENSORS", "yes").lower() in ("no", "false", "0"):
            try:
                _cudart()
            except RuntimeError as exc:  # said once at load; each such request is answered with it too
                pb_utils.Logger.log_warn(f"{args['model_name']}: {exc}")

    def execute(self, requests):
        timer = self.timer  # phases: see PhaseTimer and docs/gpu.md; None costs one test per boundary
        if timer is not None:
            timer.start()
        responses = [None] * len(requests)
        feeds = {}
        for index, request in enumerate(requests):
            feed, name = {}, None
            try:  # an input the runner cannot take (a device tensor it cannot read) fails its own request only
                for name in self.input_names:
                    feed[name] = _input(pb_utils.get_input_tensor_by_name(request, name))
            except Exception as exc:  # noqa: BLE001 - report to the client instead of failing the whole batch
                responses[index] = pb_utils.InferenceResponse(error=pb_utils.TritonError(f"input {name}: {exc}"))
                continue
            feeds[index] = feed
        groups: dict[tuple, list[int]] = {}
        for index, feed in feeds.items():
            key = tuple((n, feed[n].dtype.str, feed[n].shape[1:]) for n in self.input_names)
            groups.setdefault(key if self.batching else (index,), []).append(index)
        if timer is not None:
            timer.mark("read_inputs")
        for indices in groups.values():
            try:
                if self.batching:  # the runner concatenates (the CUDA one straight into its staging buffer)
                    produced = self.runner.run_many([feeds[i] for i in indices])
                else:
                    feed = {n: v.reshape(()) if n in self.scalars else v
                            for n, v in host_feed(feeds[indices[0]]).items()}
                    if timer is not None:
                        timer.mark("gather")
                    produced = self.runner.run(feed)
                    if timer is not None:
                        timer.mark("run")
                results = [produced[i] for i in self.order]
            except Exception as exc:  # noqa: BLE001 - report to each client instead of crashing the stub
                if out_of_memory(exc):  # in Triton's log too, as what it is
                    pb_utils.Logger.log_warn(f"batch of {len(indices)} requests: {_reason(exc)}")
                for i in indices:
                    responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(_reason(exc)))
                if timer is not None:
                    timer.mark("respond")
                continue
            if not self.batching:
                tensors = [pb_utils.Tensor(name, np.ascontiguousarray(value))
                           for name, value in zip(self.output_names, results, strict=True)]
                responses[indices[0]] = pb_utils.InferenceResponse(output_tensors=tensors)
                if timer is not None:
                    timer.mark("respond")
                continue
            start = 0
            for i in indices:
                size = len(feeds[i][self.input_names[0]])
                tensors = [
                    pb_utils.Tensor(name, np.ascontiguousarray(value[start : start + size]))
                    for name, value in zip(self.output_names, results, strict=True)
                ]
                responses[i] = pb_utils.InferenceResponse(output_tensors=tensors)
                start += size
            if timer is not None:
                timer.mark("respond")
        if timer is not None:
            rows = (sum(len(f[self.input_names[0]]) for f in feeds.values())
                    if self.batching and self.input_names else len(feeds))  # without batching a request is one row
            timer.end(len(requests), rows)
        return responses

    def finalize(self):
        """The timers' last figures (Triton calls this when the model unloads or the server stops)."""
        timer = getattr(self, "timer", None)
        if timer is not None and timer.write_failed is None:
            try:
                timer.write(final=True)
            except OSError as exc:
                log.warning("runner timers: the last write to %s failed (%s)", timer.folder, exc)
