"""Power policy: where a point's energy is read, and the checks made before anything is measured."""

from __future__ import annotations

import ipaddress
import logging
import socket

from builder.errors import BuilderError
from builder.tuning.control import Endpoints
from client import power, session

log = logging.getLogger(__name__)


def power_source(endpoints: Endpoints | None) -> power.PowerSource:
    """Where a point's energy is read. A server on another host (a pod, a GPU box) is measured by its
    own `nv_energy_consumption`: this machine's NVML or RAPL would meter the wrong hardware. A server on
    this host: perfclient's auto order (NVML, Triton's metrics, RAPL)."""
    if endpoints is None:
        return power.PowerSource.AUTO
    host = endpoints.grpc.rpartition(":")[0].strip("[]").lower().rstrip(".")
    if host in {"localhost", socket.gethostname().lower(), socket.getfqdn().lower()}:
        return power.PowerSource.AUTO
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # a name other than this host's own
        return power.PowerSource.TRITON
    # Compared as addresses, not as text: "::", "0:0:0:0:0:0:0:1" and "::ffff:127.0.0.1" are this host too.
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    local = any(a.is_loopback or a.is_unspecified for a in (address, mapped) if a is not None)
    return power.PowerSource.AUTO if local else power.PowerSource.TRITON


def require_power(attach: Endpoints | None) -> None:
    """Fail before anything is measured when perfclient would find no energy reading, which
    `--objective infer_per_joule` ranks by. Probes what perfclient's `auto` source tries: NVML and RAPL
    here, and for an attached server its metrics endpoint. A private server's Triton metrics are left
    out: Triton reports GPU energy through NVML, so they have none where NVML has none."""
    if attach is not None:
        metrics = attach.metrics or f"http://{attach.grpc.rpartition(':')[0]}:{session.METRICS_PORT}/metrics"
        source = power_source(attach)
        sources = [(source, metrics)]
        expected = (f"nv_energy_consumption on {metrics} (the server is on another host)"
                    if source is power.PowerSource.TRITON else
                    f"an NVIDIA GPU readable through NVML, RAPL readable here, or nv_energy_consumption on {metrics}")
    else:
        sources = [(power.PowerSource.NVML, ""), (power.PowerSource.RAPL, "")]
        expected = "an NVIDIA GPU readable through NVML, or RAPL energy counters readable under /sys/class/powercap"
    reasons = []
    for source, url in sources:
        meter = power.open_meter(source, url)
        meter.close()
        if meter.source is not power.PowerSource.NONE:
            log.debug("tune: power source %s", meter.source)
            return
        reasons.append(" ".join(str(meter.reason).split()))  # one line whatever the library said
    raise BuilderError(f"--objective infer_per_joule: expected a power source ({expected}); "
                       f"found none ({'; '.join(reasons)})")


def require_gpus(attach: Endpoints | None, gpus: tuple[str, ...]) -> None:
    """--gpus: fail before anything is measured when no meter finds those GPUs, which every point's
    perfclient session would refuse (NVML here; for an attached server, its metrics endpoint too)."""
    url = "" if attach is None else (attach.metrics or
                                     f"http://{attach.grpc.rpartition(':')[0]}:{session.METRICS_PORT}/metrics")
    # A private server's Triton metric reads NVML too: where NVML has no such GPU, neither has the metric.
    source = power.PowerSource.NVML if attach is None else power_source(attach)
    meter = power.open_meter(source, url, gpus=power.GpuSelection(gpus, "--gpus"))
    meter.close()
    if meter.source is power.PowerSource.NONE:
        raise BuilderError(f"--gpus {','.join(gpus)}: no meter counts these GPUs "
                           f"({' '.join(str(meter.reason).split())})")
