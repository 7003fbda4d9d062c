"""Hill climbing's winner vs exhaustive search's winner, measured alternately on one server.

    python bench/tune_ab.py   (after make engines; points as found on 2026-11-22)
"""

import statistics
from pathlib import Path

from builder.serving.tune import Point, TuneServer

a = Point("efficientnet_lite0_int8", 8, 0, 1)   # exhaustive's winner
b = Point("efficientnet_lite0_int8", 16, 0, 1)  # hill climbing's winner
res: dict[Point, list[float]] = {a: [], b: []}
with TuneServer(Path("model_repository"), ["efficientnet_lite0_int8"], [32], 1500, 4) as s:
    for _ in range(3):
        for p in (a, b):
            res[p].append(s.measure(p)[0].throughput)
for p, v in res.items():
    print(p.label(), [round(x, 1) for x in v], "median", round(statistics.median(v), 1))
print("hill/exhaustive median ratio", round(statistics.median(res[b]) / statistics.median(res[a]), 3))
