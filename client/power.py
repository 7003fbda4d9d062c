"""Energy and power meters: NVML (energy counter + instant power), Triton's metrics endpoint, RAPL.

The energy counter is the basis for joules per window; sampled power only draws the curve and
cross-checks the counter. The chosen source is named in every result, or `none` with the reasons.

GPU meters count the GPUs of a GpuSelection (--gpus, the measured models' instance groups, or
CUDA_VISIBLE_DEVICES: client.session chooses), each GPU's energy kept apart in the reading; NVML and
Triton's metric select the same devices: by UUID, or by index (NVML's index; in Triton's metrics text,
the order of its `gpu_uuid` series, which Triton lists by device id).
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from common.choices import Choice

log = logging.getLogger(__name__)


class PowerSource(Choice):
    """Where energy comes from; `auto` tries nvml, then triton, then rapl."""

    AUTO = "auto"
    NVML = "nvml"
    TRITON = "triton"
    RAPL = "rapl"
    NONE = "none"


@dataclass(frozen=True)
class Reading:
    t: float  # time.monotonic() when the counter was read (the call's start: what a window boundary aligns to)
    energy_j: float | None  # cumulative, summed over the devices metered
    per_gpu: Mapping[str, float] = field(default_factory=dict)  # cumulative J by GPU (UUID), where metered apart


_GPU_ID = re.compile(r"^(\d+|(GPU|MIG)-[0-9A-Za-z/-]+)$")


def parse_gpus(text: str, flag: str = "--gpus") -> tuple[str, ...]:
    """`0,3` or UUIDs (`GPU-…`, `MIG-…`), comma-separated; ValueError naming `flag` otherwise."""
    ids = tuple(part.strip() for part in text.split(",") if part.strip())
    bad = [i for i in ids if not _GPU_ID.match(i)]
    if not ids or bad:
        raise ValueError(f"{flag} {text!r}: expected GPU indices or UUIDs separated by commas (0,3 or GPU-…)")
    return tuple(dict.fromkeys(ids))


@dataclass(frozen=True)
class GpuSelection:
    """The GPUs a meter counts: `ids` are indices or UUIDs, None every GPU; `origin` says who chose them."""

    ids: tuple[str, ...] | None = None
    origin: str = "every GPU"

    def pick(self, devices: Sequence[str]) -> list[int]:
        """The positions in `devices` (UUIDs, in index order) that the selection names; RuntimeError naming
        what is there when it names a device that is not."""
        if self.ids is None:
            return list(range(len(devices)))
        chosen = []
        for gpu in self.ids:
            position = int(gpu) if gpu.isdigit() else (devices.index(gpu) if gpu in devices else len(devices))
            if position >= len(devices):
                there = ", ".join(f"{i} {uuid}" for i, uuid in enumerate(devices)) or "none"
                raise RuntimeError(f"GPU {gpu} ({self.origin}) is not here (GPUs: {there})")
            chosen.append(position)
        return sorted(set(chosen))

    def __str__(self) -> str:
        return f"{','.join(self.ids)} ({self.origin})" if self.ids is not None else self.origin


class Meter(Protocol):
    @property
    def source(self) -> PowerSource: ...

    @property
    def trace(self) -> PowerTrace | None:
        """Instant-power samples, where the source takes them."""

    @property
    def reason(self) -> str | None:
        """Why there is no energy reading (the `none` source)."""

    def read(self) -> Reading: ...

    def close(self) -> None: ...


@dataclass
class PowerTrace:
    """Instant power samples taken by a background thread: (monotonic seconds, watts)."""

    samples: list[tuple[float, float]] = field(default_factory=list)

    def integrate(self, start: float, end: float) -> float | None:
        """Joules between start and end by the trapezoid rule over the samples inside."""
        points = [(t, w) for t, w in self.samples if start <= t <= end]
        if len(points) < 2:
            return None
        return sum((t1 - t0) * (w0 + w1) / 2 for (t0, w0), (t1, w1) in itertools.pairwise(points))


class NvmlMeter:
    source = PowerSource.NVML
    reason = None

    def __init__(self, sample_interval: float = 0.05, gpus: GpuSelection | None = None) -> None:
        import pynvml

        self._nvml: Any = pynvml
        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
            if count == 0:
                raise RuntimeError("NVML found no GPU")
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            uuids = [self._uuid(h, i) for i, h in enumerate(handles)]
            self.selection = gpus or GpuSelection()
            chosen = self.selection.pick(uuids)
            self.handles = [handles[i] for i in chosen]
            self.gpus = [uuids[i] for i in chosen]  # the metered GPUs' UUIDs, as `handles`
            self.trace = PowerTrace()
            self._stop = threading.Event()
            self._interval = sample_interval
            self._thread = threading.Thread(target=self._sample, name="nvml-power", daemon=True)
            self.read()  # fail now, not mid-run, if the counters are not readable
        except BaseException:
            pynvml.nvmlShutdown()  # every failed open releases NVML (the tuner probes before each run)
            raise
        self._thread.start()

    def _uuid(self, handle: Any, index: int) -> str:
        try:
            uuid = self._nvml.nvmlDeviceGetUUID(handle)
        except (AttributeError, self._nvml.NVMLError):  # an NVML without UUIDs: the index names the GPU
            return f"GPU {index}"
        return uuid.decode() if isinstance(uuid, bytes) else str(uuid)

    def instant_power_w(self) -> float:
        total = 0.0
        for handle in self.handles:
            try:
                field_id = self._nvml.NVML_FI_DEV_POWER_INSTANT
                value = self._nvml.nvmlDeviceGetFieldValues(handle, [field_id])[0]
                if value.nvmlReturn == 0:
                    total += value.value.uiVal / 1000.0
                    continue
            except (AttributeError, self._nvml.NVMLError):
                pass
            total += self._nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
        return total

    def _sample(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.trace.samples.append((time.monotonic(), self.instant_power_w()))
            except self._nvml.NVMLError as exc:
                log.debug("NVML power sample failed: %s", exc)

    def read(self) -> Reading:
        t = time.monotonic()
        per_gpu = {gpu: self._nvml.nvmlDeviceGetTotalEnergyConsumption(h) / 1000.0
                   for gpu, h in zip(self.gpus, self.handles, strict=True)}
        return Reading(t, sum(per_gpu.values()), per_gpu)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)
        self._nvml.nvmlShutdown()


_ENERGY_LINE = re.compile(r"^nv_energy_consumption\{([^}]*)\}\s+([0-9.eE+-]+)", re.M)
_GPU_UUID = re.compile(r'gpu_uuid="([^"]*)"')


def parse_triton_energy(text: str) -> float | None:
    """Joules summed over GPUs from Triton's Prometheus text; None without a GPU energy metric."""
    values = _ENERGY_LINE.findall(text)
    return sum(float(v) for _, v in values) if values else None


def parse_triton_energy_per_gpu(text: str) -> dict[str, float]:
    """Joules by `gpu_uuid`, in the order Triton lists them (its device ids); empty without the metric."""
    out: dict[str, float] = {}
    for index, (labels, value) in enumerate(_ENERGY_LINE.findall(text)):
        uuid = _GPU_UUID.search(labels)
        gpu = uuid.group(1) if uuid else f"GPU {index}"
        out[gpu] = out.get(gpu, 0.0) + float(value)
    return out


class TritonMetricsMeter:
    """Triton's Prometheus endpoint: nv_energy_consumption (J, cumulative, summed over GPUs)."""

    source = PowerSource.TRITON
    trace = None
    reason = None

    def __init__(self, url: str, gpus: GpuSelection | None = None) -> None:
        self.url = url
        self.selection = gpus or GpuSelection()
        every = parse_triton_energy_per_gpu(self._text())
        if not every:
            raise RuntimeError(f"{url} has no nv_energy_consumption (no GPU metrics)")
        devices = list(every)
        self.gpus = [devices[i] for i in self.selection.pick(devices)]  # the metered GPUs' UUIDs

    def _text(self) -> str:
        try:
            with urllib.request.urlopen(self.url, timeout=2) as response:
                return str(response.read().decode("utf-8", "replace"))
        except (urllib.error.URLError, OSError) as exc:
            raise RuntimeError(f"cannot read {self.url}: {exc}") from exc

    def read(self) -> Reading:
        """Blocking HTTP: the load engine calls it from a worker thread, never on its event loop."""
        t = time.monotonic()
        every = parse_triton_energy_per_gpu(self._text())
        if any(gpu not in every for gpu in self.gpus):  # a GPU's series is gone: no reading, not a smaller sum
            return Reading(t, None)
        per_gpu = {gpu: every[gpu] for gpu in self.gpus}
        return Reading(t, sum(per_gpu.values()), per_gpu)

    def close(self) -> None:
        pass


RAPL_ROOT = Path("/sys/class/powercap")


class RaplMeter:
    """CPU package energy from /sys/class/powercap (root-only on Linux >= 5.10)."""

    source = PowerSource.RAPL
    trace = None
    reason = None

    def __init__(self, root: Path = RAPL_ROOT) -> None:
        self.domains = sorted(p for p in root.glob("intel-rapl:*") if p.name.count(":") == 1)
        if not self.domains:
            raise RuntimeError(f"no RAPL domains under {root}")
        self._last: list[int] = []
        self._total = 0.0
        self._ranges = []
        for domain in self.domains:
            try:
                self._ranges.append(int((domain / "max_energy_range_uj").read_text()))
                int((domain / "energy_uj").read_text())
            except (OSError, ValueError) as exc:
                raise RuntimeError(f"{domain / 'energy_uj'} is not readable ({exc})") from exc
        self._last = self._raw()

    def _raw(self) -> list[int]:
        return [int((d / "energy_uj").read_text()) for d in self.domains]

    def read(self) -> Reading:
        t = time.monotonic()
        now = self._raw()
        for i, (prev, cur) in enumerate(zip(self._last, now, strict=True)):
            delta = cur - prev if cur >= prev else cur + self._ranges[i] - prev  # counter wrapped
            self._total += delta / 1e6
        self._last = now
        return Reading(t, self._total)

    def close(self) -> None:
        pass


class NoMeter:
    source = PowerSource.NONE
    trace = None

    def __init__(self, reason: str) -> None:
        self.reason: str | None = reason

    def read(self) -> Reading:
        return Reading(time.monotonic(), None)

    def close(self) -> None:
        pass


def open_meter(source: PowerSource, metrics_url: str, *, rapl_root: Path = RAPL_ROOT,
               gpus: GpuSelection | None = None) -> Meter:
    """The first source that works, in order nvml → triton → rapl; `none` with every reason otherwise.
    `rapl_root`: where the powercap tree is (another folder in tests). `gpus`: the GPUs NVML and Triton's
    metric count (every GPU by default); where it names GPUs, auto does not fall back to RAPL."""
    order = [PowerSource.NVML, PowerSource.TRITON, PowerSource.RAPL] if source is PowerSource.AUTO else [source]
    if source is PowerSource.AUTO and gpus is not None and gpus.ids is not None:
        order.remove(PowerSource.RAPL)  # it meters the CPU packages, not the GPUs named
    openers: dict[PowerSource, Callable[[], Meter]] = {
        PowerSource.NVML: lambda: NvmlMeter(gpus=gpus), PowerSource.RAPL: lambda: RaplMeter(rapl_root),
        PowerSource.TRITON: lambda: TritonMetricsMeter(metrics_url, gpus)}
    reasons = []
    for name in order:
        if name is PowerSource.NONE:
            break
        try:
            meter: Meter = openers[name]()
        except Exception as exc:  # noqa: BLE001 - each failure becomes part of the reason
            reasons.append(f"{name}: {str(exc).strip() or type(exc).__name__}")
        else:
            log.debug("power source: %s", name)
            return meter
    return NoMeter("; ".join(reasons) or "disabled by --power-source none")


def open_cross_checks(primary: Meter, metrics_url: str, gpus: GpuSelection | None = None) -> list[Meter]:
    """Second sources read at the same instants as the primary, to cross-check its energy (the same GPUs)."""
    if primary.source is not PowerSource.NVML:
        return []
    try:
        return [TritonMetricsMeter(metrics_url, gpus)]
    except Exception as exc:  # noqa: BLE001 - a missing cross-check is only logged
        log.info("no Triton energy metric to cross-check NVML: %s", exc)
        return []


@dataclass(frozen=True)
class PowerFigures:
    """Energy over an interval from the chosen source; every figure None where it was not measured.

    `reason` says why there is no energy (source `none`, or a source whose reading failed).
    `energy_j_from_samples` integrates the instant-power samples; `cross_checks` holds the energy
    that each second source counted over the same instants, for comparison with `energy_j`.
    """

    source: PowerSource
    reason: str | None = None
    avg_w: float | None = None
    energy_j: float | None = None
    j_per_infer: float | None = None
    infer_per_j: float | None = None
    energy_j_from_samples: float | None = None
    cross_checks: Mapping[PowerSource, float | None] = field(default_factory=dict)
    gpus: tuple[GpuEnergy, ...] = ()  # each metered GPU's figures; `energy_j` and `avg_w` are their total
    gpu_selection: str | None = None  # which GPUs were metered and who chose them (GpuSelection's text)


@dataclass(frozen=True)
class GpuEnergy:
    """One GPU's share of an interval."""

    gpu: str  # its UUID
    avg_w: float
    energy_j: float


def window_power(meter: Meter, before: Reading, after: Reading, inferences: int,
                 cross: Sequence[tuple[PowerSource, Reading, Reading]] = ()) -> PowerFigures:
    if before.energy_j is None or after.energy_j is None:
        return PowerFigures(source=meter.source, reason=meter.reason or "no energy reading")
    seconds = max(after.t - before.t, 1e-9)
    energy = after.energy_j - before.energy_j
    integrated = meter.trace.integrate(before.t, after.t) if meter.trace is not None else None
    checks = {source: (a.energy_j - b.energy_j if b.energy_j is not None and a.energy_j is not None else None)
              for source, b, a in cross}
    gpus = tuple(GpuEnergy(gpu, (after.per_gpu[gpu] - joules) / seconds, after.per_gpu[gpu] - joules)
                 for gpu, joules in before.per_gpu.items() if gpu in after.per_gpu)
    selection = getattr(meter, "selection", None)
    return PowerFigures(
        source=meter.source,
        avg_w=energy / seconds,
        energy_j=energy,
        j_per_infer=energy / inferences if inferences else None,
        infer_per_j=inferences / energy if energy > 0 else None,
        energy_j_from_samples=integrated,
        cross_checks=checks,
        gpus=gpus,
        gpu_selection=str(selection) if selection is not None else None,
    )
