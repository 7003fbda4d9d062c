"""Two serving points of one model variant (hill climbing's winner against exhaustive search's, by
default), measured alternately on one private server; the medians and their ratio.

A point that fails (does not load, times out, completes no request) is recorded with its reason and
the rounds go on; the summary names every failure, and the ratio needs a median on both sides.

    python bench/tune_ab.py [--repository model_repository] [--model efficientnet_lite0_int8]
        [--a 8,0,1] [--b 16,0,1] [--concurrency 32] [--measurement-interval 1500] [--max-trials 4]
        [--rounds 3]

The defaults are the points found on 2026-11-22 (after make engines). A point is
MAX_BATCH,QUEUE_DELAY_US,INSTANCES, the delay `off` for no dynamic batching. Exit status: 0 when
both points have a median, 1 when one never measured (or the server stopped answering).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from builder.errors import BuilderError, ServerError
from builder.tuning.measure import Tuner, TuneServer
from builder.tuning.points import Point


@dataclass
class Side:
    """One point's rounds: the throughputs measured and the reasons of the rounds that failed."""

    name: str
    point: Point
    throughputs: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    tried: int = 0  # rounds begun: the one a dying server cut short counts, those never reached do not

    @property
    def median(self) -> float | None:
        return statistics.median(self.throughputs) if self.throughputs else None

    def line(self) -> str:
        values = [round(x, 1) for x in self.throughputs]
        median = "-" if self.median is None else f"{self.median:.1f}"
        failed = "".join(f"\n    failed: {reason}" for reason in self.failures)
        return f"{self.name}: {self.point.label()} {values} median {median}{failed}"


def serving_point(text: str) -> tuple[int, int | None, int]:
    """MAX_BATCH,QUEUE_DELAY_US,INSTANCES (the delay `off`: no dynamic batching)."""
    parts = [p.strip() for p in text.split(",")]
    try:
        if len(parts) != 3:
            raise ValueError
        mbs, delay, instances = int(parts[0]), None if parts[1] == "off" else int(parts[1]), int(parts[2])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected MAX_BATCH,QUEUE_DELAY_US,INSTANCES (e.g. 8,0,1; the delay may be off)") from None
    if mbs < 0 or instances < 1 or (delay is not None and delay < 0):
        raise argparse.ArgumentTypeError(f"{text!r}: expected max batch >= 0, delay >= 0 or off, instances >= 1")
    return mbs, delay, instances


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer")
    return value


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repository", type=Path, default=Path("model_repository"))
    p.add_argument("--model", default="efficientnet_lite0_int8", help="the variant (a folder of --repository)")
    p.add_argument("--a", type=serving_point, default=(8, 0, 1), metavar="MBS,DELAY,INST",
                   help="the first point (default: exhaustive search's winner, 8,0,1)")
    p.add_argument("--b", type=serving_point, default=(16, 0, 1), metavar="MBS,DELAY,INST",
                   help="the second point (default: hill climbing's winner, 16,0,1); the ratio is b/a")
    p.add_argument("--concurrency", type=positive, default=32)
    p.add_argument("--measurement-interval", type=positive, default=1500, help="ms per window")
    p.add_argument("--max-trials", type=positive, default=4, help="windows per measurement at most")
    p.add_argument("--rounds", type=positive, default=3, help="measurements of each point, alternately")
    args = p.parse_args(argv)
    config = args.repository / args.model / "config.pbtxt"
    if not config.is_file():
        p.error(f"--model {args.model}: expected a variant folder with config.pbtxt in --repository "
                f"{args.repository} ({config} is missing; run make engines first)")
    return args


def measure_once(tuner: Tuner, side: Side) -> None:
    """One round of one point; a failure is recorded with its reason (ServerError, a dead server, is raised)."""
    side.tried += 1
    tuner.failures.pop(side.point, None)
    results = tuner.remeasure(side.point)
    reason = tuner.failures.get(side.point)
    if reason is None and not results:
        reason = "no result"  # the tuner records a reason with every failure; this is the safety net
    if reason is not None:
        side.failures.append(reason)
    else:
        side.throughputs.append(sum(r.throughput for r in results) / len(results))


def summary(sides: Sequence[Side], rounds: int, stopped: str | None) -> list[str]:
    lines = [side.line() for side in sides]
    a, b = sides
    if a.median is not None and b.median is not None and a.median > 0:
        lines.append(f"b/a median ratio {b.median / a.median:.3f}")
    else:
        lines.append("no ratio: " + "; ".join(f"{s.name} measured nothing in {s.tried} of {rounds} rounds"
                                              for s in sides if s.median is None or s.median <= 0))
    if stopped:
        lines.append(f"partial: {stopped}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    sides = [Side("a", Point(args.model, *args.a)), Side("b", Point(args.model, *args.b))]
    stopped: str | None = None
    try:
        with TuneServer(args.repository, [args.model], [args.concurrency], args.measurement_interval,
                        args.max_trials) as tuner:
            for _ in range(args.rounds):
                for side in sides:
                    measure_once(tuner, side)
    except ServerError as exc:  # the server did not start or stopped answering: report what was measured
        stopped = str(exc)
    except BuilderError as exc:
        print(f"tune_ab: error: {exc}", file=sys.stderr)
        return 1
    for line in summary(sides, args.rounds, stopped):
        print(line)
    return 0 if stopped is None and all(s.median is not None for s in sides) else 1


if __name__ == "__main__":
    sys.exit(main())
