"""Peak memory and time of a whole `trtbuild build` of corpus models, two source trees side by side, alternating.

    python bench/build_memory.py --before TREE --after TREE [--models captcha_crnn,isbnx_det] [--rounds 3]
        [--out FILE.jsonl]

TREE is a checkout of this project (e.g. `git worktree add /tmp/before a5360c8`); each build runs this venv's
interpreter with that tree first on PYTHONPATH, so only the product's code differs. Every build starts from an
empty cache (TRTBUILD_CACHE in a fresh temporary folder: no calibration or conversion is reused) and builds all
three precisions with the corpus entry's own flags and data (fetched and made where missing). Two peaks per
build: the build process's own (ru_maxrss from wait4: its largest process, as corpus.py reports it) and the whole
process tree's (the sum of every process's RSS, sampled every 0.1 s: the build and its quantizer subprocess
together, what the machine must hold). Rounds alternate the order of the trees. Prints one JSON line per build and
a summary per model and tree (median and range).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent / "corpus"))
corpus: Any = importlib.import_module("corpus")

SAMPLE_SECONDS = 0.1


def _tree_rss(root: psutil.Process) -> int:
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            continue  # ended between the listing and the read
    return total


def build(tree: Path, entry: Any, work: Path) -> dict[str, Any]:
    cache = work / "cache"
    command = [sys.executable, "-m", "builder", "build", "--onnx", str(entry.onnx), "--name", entry.name,
               "--repository", str(work / "repo"), "--precision", "fp32,fp16,int8", "--calibration", str(entry.npz),
               "--log", str(work / "build.log"), "--force", *entry.flags]
    env = {**os.environ, "PYTHONPATH": str(tree), "TRTBUILD_CACHE": str(cache)}
    started = time.perf_counter()
    child = subprocess.Popen(command, env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    root = psutil.Process(child.pid)
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            with contextlib.suppress(psutil.Error):
                peak = max(peak, _tree_rss(root))
            stop.wait(SAMPLE_SECONDS)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stderr = child.stderr.read() if child.stderr else ""
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - started
    stop.set()
    sampler.join()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.exit(f"build_memory: {entry.name} with {tree} exited {code}:\n{stderr[-3000:]}")
    return {"model": entry.name, "tree": str(tree), "seconds": round(seconds, 1),
            "process_peak_mib": round(usage.ru_maxrss / 1024), "tree_peak_mib": round(peak / 2**20)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, required=True)
    p.add_argument("--after", type=Path, required=True)
    p.add_argument("--models", default="captcha_crnn,isbnx_det")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    entries = corpus.select(corpus.load_list(), args.models.split(","))
    for entry in entries:  # the ONNX file and the data, fetched and made where missing (as corpus.py does)
        corpus.fetch(entry)
        corpus.make_data(entry)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    results: list[dict[str, Any]] = []
    sink = args.out.open("a") if args.out else None
    for round_index in range(args.rounds):
        order = list(trees) if round_index % 2 == 0 else list(reversed(trees))
        for entry in entries:
            for label in order:
                with tempfile.TemporaryDirectory(prefix="build-memory-") as tmp:
                    row = {"round": round_index + 1, "label": label, **build(trees[label], entry, Path(tmp))}
                results.append(row)
                line = json.dumps(row)
                print(line, flush=True)
                if sink:
                    sink.write(line + "\n")
                    sink.flush()
    for entry in entries:
        for label in trees:
            rows = [r for r in results if r["model"] == entry.name and r["label"] == label]

            def spread(key: str, rows: list[dict[str, Any]] = rows) -> str:
                values = [r[key] for r in rows]
                return f"{statistics.median(values):g} ({min(values):g}-{max(values):g})"

            print(f"{entry.name:14} {label:6} tree peak MiB {spread('tree_peak_mib')}, process peak MiB "
                  f"{spread('process_peak_mib')}, seconds {spread('seconds')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
