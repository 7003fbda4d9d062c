"""Energy and power meters: NVML (energy counter + instant power), Triton's metrics endpoint, RAPL.

The energy counter is the basis for joules per window; sampled power only draws the curve and
cross-checks the counter. The chosen source is named in every result, or `none` with the reasons.
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

from client.choices import Choice

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
    energy_j: float | None  # cumulative, summed over devices


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

    def __init__(self, sample_interval: float = 0.05) -> None:
        import pynvml

        self._nvml: Any = pynvml
        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
            if count == 0:
                raise RuntimeError("NVML found no GPU")
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self.trace = PowerTrace()
            self._stop = threading.Event()
            self._interval = sample_interval
            self._thread = threading.Thread(target=self._sample, name="nvml-power", daemon=True)
            self.read()  # fail now, not mid-run, if the counters are not readable
        except BaseException:
            pynvml.nvmlShutdown()  # every failed open releases NVML (the tuner probes before each run)
            raise
        self._thread.start()

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
        energy = sum(self._nvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in self.handles) / 1000.0
        return Reading(t, energy)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)
        self._nvml.nvmlShutdown()


_ENERGY_LINE = re.compile(r"^nv_energy_consumption\{[^}]*\}\s+([0-9.eE+-]+)", re.M)


def parse_triton_energy(text: str) -> float | None:
    """Joules summed over GPUs from Triton's Prometheus text; None without a GPU energy metric."""
    values = _ENERGY_LINE.findall(text)
    return sum(float(v) for v in values) if values else None


class TritonMetricsMeter:
    """Triton's Prometheus endpoint: nv_energy_consumption (J, cumulative, summed over GPUs)."""

    source = PowerSource.TRITON
    trace = None
    reason = None

    def __init__(self, url: str) -> None:
        self.url = url
        if self.read().energy_j is None:
            raise RuntimeError(f"{url} has no nv_energy_consumption (no GPU metrics)")

    def read(self) -> Reading:
        """Blocking HTTP: the load engine calls it from a worker thread, never on its event loop."""
        t = time.monotonic()
        try:
            with urllib.request.urlopen(self.url, timeout=2) as response:
                text = response.read().decode("utf-8", "replace")
        except (urllib.error.URLError, OSError) as exc:
            raise RuntimeError(f"cannot read {self.url}: {exc}") from exc
        return Reading(t, parse_triton_energy(text))

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


def open_meter(source: PowerSource, metrics_url: str, *, rapl_root: Path = RAPL_ROOT) -> Meter:
    """The first source that works, in order nvml → triton → rapl; `none` with every reason otherwise.
    `rapl_root`: where the powercap tree is (another folder in tests)."""
    order = [PowerSource.NVML, PowerSource.TRITON, PowerSource.RAPL] if source is PowerSource.AUTO else [source]
    openers: dict[PowerSource, Callable[[], Meter]] = {
        PowerSource.NVML: NvmlMeter, PowerSource.RAPL: lambda: RaplMeter(rapl_root),
        PowerSource.TRITON: lambda: TritonMetricsMeter(metrics_url)}
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


def open_cross_checks(primary: Meter, metrics_url: str) -> list[Meter]:
    """Second sources read at the same instants as the primary, to cross-check its energy."""
    if primary.source is not PowerSource.NVML:
        return []
    try:
        return [TritonMetricsMeter(metrics_url)]
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


def window_power(meter: Meter, before: Reading, after: Reading, inferences: int,
                 cross: Sequence[tuple[PowerSource, Reading, Reading]] = ()) -> PowerFigures:
    if before.energy_j is None or after.energy_j is None:
        return PowerFigures(source=meter.source, reason=meter.reason or "no energy reading")
    seconds = max(after.t - before.t, 1e-9)
    energy = after.energy_j - before.energy_j
    integrated = meter.trace.integrate(before.t, after.t) if meter.trace is not None else None
    checks = {source: (a.energy_j - b.energy_j if b.energy_j is not None and a.energy_j is not None else None)
              for source, b, a in cross}
    return PowerFigures(
        source=meter.source,
        avg_w=energy / seconds,
        energy_j=energy,
        j_per_infer=energy / inferences if inferences else None,
        infer_per_j=inferences / energy if energy > 0 else None,
        energy_j_from_samples=integrated,
        cross_checks=checks,
    )
