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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

SOURCES = ("auto", "nvml", "triton", "rapl", "none")


@dataclass(frozen=True)
class Reading:
    t: float  # time.monotonic()
    energy_j: float | None  # cumulative, summed over devices
    power_w: float | None


class Meter(Protocol):
    source: str

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
    source = "nvml"

    def __init__(self, sample_interval: float = 0.05) -> None:
        import pynvml

        self._nvml: Any = pynvml
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            pynvml.nvmlShutdown()
            raise RuntimeError("NVML found no GPU")
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self.names = [str(pynvml.nvmlDeviceGetName(h)) for h in self.handles]
        self.trace = PowerTrace()
        self._stop = threading.Event()
        self._interval = sample_interval
        self._thread = threading.Thread(target=self._sample, name="nvml-power", daemon=True)
        self.read()  # fail now, not mid-run, if the counters are not readable
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
        energy = sum(self._nvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in self.handles) / 1000.0
        power = sum(self._nvml.nvmlDeviceGetPowerUsage(h) for h in self.handles) / 1000.0
        return Reading(time.monotonic(), energy, power)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)
        self._nvml.nvmlShutdown()


_METRIC_LINE = re.compile(r"^(nv_energy_consumption|nv_gpu_power_usage)\{[^}]*\}\s+([0-9.eE+-]+)", re.M)


def parse_triton_metrics(text: str) -> tuple[float | None, float | None]:
    energy = power = None
    for name, value in _METRIC_LINE.findall(text):
        if name == "nv_energy_consumption":
            energy = (energy or 0.0) + float(value)
        else:
            power = (power or 0.0) + float(value)
    return energy, power


class TritonMetricsMeter:
    """Triton's Prometheus endpoint: nv_energy_consumption (J, cumulative) and nv_gpu_power_usage (W)."""

    source = "triton"

    def __init__(self, url: str) -> None:
        self.url = url
        if self.read().energy_j is None:
            raise RuntimeError(f"{url} has no nv_energy_consumption (no GPU metrics)")

    def read(self) -> Reading:
        try:
            with urllib.request.urlopen(self.url, timeout=2) as response:
                text = response.read().decode("utf-8", "replace")
        except (urllib.error.URLError, OSError) as exc:
            raise RuntimeError(f"cannot read {self.url}: {exc}") from exc
        energy, power = parse_triton_metrics(text)
        return Reading(time.monotonic(), energy, power)

    def close(self) -> None:
        pass


class RaplMeter:
    """CPU package energy from /sys/class/powercap (root-only on Linux >= 5.10)."""

    source = "rapl"

    def __init__(self, root: Path = Path("/sys/class/powercap")) -> None:
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
        now = self._raw()
        for i, (prev, cur) in enumerate(zip(self._last, now, strict=True)):
            delta = cur - prev if cur >= prev else cur + self._ranges[i] - prev  # counter wrapped
            self._total += delta / 1e6
        self._last = now
        return Reading(time.monotonic(), self._total, None)

    def close(self) -> None:
        pass


class NoMeter:
    source = "none"

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def read(self) -> Reading:
        return Reading(time.monotonic(), None, None)

    def close(self) -> None:
        pass


def open_meter(source: str, metrics_url: str) -> Meter:
    """The first source that works, in order nvml → triton → rapl; `none` with every reason otherwise."""
    if source not in SOURCES:
        from client.errors import PerfClientError

        raise PerfClientError(f"--power-source {source!r}: expected one of {', '.join(SOURCES)}")
    order = ["nvml", "triton", "rapl"] if source == "auto" else [source]
    reasons = []
    for name in order:
        if name == "none":
            break
        try:
            if name == "nvml":
                return NvmlMeter()
            if name == "triton":
                return TritonMetricsMeter(metrics_url)
            return RaplMeter()
        except Exception as exc:  # noqa: BLE001 - each failure becomes part of the reason
            reasons.append(f"{name}: {str(exc).strip() or type(exc).__name__}")
    return NoMeter("; ".join(reasons) or "disabled by --power-source none")


def open_cross_checks(primary: Meter, metrics_url: str) -> list[Meter]:
    """Second sources read at the same instants as the primary, to cross-check its energy."""
    if primary.source != "nvml":
        return []
    try:
        return [TritonMetricsMeter(metrics_url)]
    except Exception as exc:  # noqa: BLE001 - a missing cross-check is only logged
        log.info("no Triton energy metric to cross-check NVML: %s", exc)
        return []


def window_power(meter: Meter, before: Reading, after: Reading, inferences: int,
                 cross: list[tuple[str, Reading, Reading]] | None = None) -> dict[str, object]:
    result: dict[str, object] = {"source": meter.source}
    if before.energy_j is None or after.energy_j is None:
        result["reason"] = getattr(meter, "reason", "no energy reading")
        return result
    seconds = max(after.t - before.t, 1e-9)
    energy = after.energy_j - before.energy_j
    result.update({
        "avg_w": energy / seconds,
        "energy_j": energy,
        "j_per_infer": energy / inferences if inferences else None,
        "infer_per_j": inferences / energy if energy > 0 else None,
    })
    trace = getattr(meter, "trace", None)
    if isinstance(trace, PowerTrace):
        integrated = trace.integrate(before.t, after.t)
        if integrated is not None:
            result["energy_j_from_samples"] = integrated
    for source, b, a in cross or []:
        if b.energy_j is not None and a.energy_j is not None:
            result[f"energy_j_from_{source}"] = a.energy_j - b.energy_j
    return result
