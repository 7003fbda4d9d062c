"""`make test`'s tests as concurrent pytest processes, for a host where one serial run outlasts a call of the device
tool (10 minutes; serially the server tier alone takes longer on the GPU hosts).

    .venv/bin/python bench/gpu/test_groups.py --out DIR [--shards 5] [--timeout 380]

Groups: `a` the unit tests under tests/builder, `b` the other unit tests, and `c0`..`cN-1` the server and slow
tests, their files split greedily by test count (the largest file first onto the lightest shard). Every group runs
`python -m pytest -q -rfEs` (failures, errors and skips listed with their reasons) with the same interpreter, all
at once, each under its own timeout, after `make` has installed the tool venvs `make test` needs (checkov,
kubectl); each group's output goes to DIR/test-GROUP.log and the summary (group, selection, pytest's last line,
exit status, seconds) is printed and written to DIR/test-groups.md. Exit status: 0
when every group passed, else 1. The device tool returns at most 8 files: 5 shards fill them with the 7 logs and
the summary.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

UNIT = "not server and not slow"
# What `make test` installs before its tests besides the venv (the deployment tests' kubectl and checkov): a run
# after `make install` alone failed 26 deployment tests on "kubectl not found" (H200, 2026-11-29).
TOOLS = (".tools/checkov/.installed", ".tools/kubectl/.installed")


def server_files() -> Counter[str]:
    """Test count per file among the server and slow tests."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "server or slow", "tests"],
                          capture_output=True, text=True, check=False)
    if proc.returncode not in (0, 5):  # 5: nothing selected
        sys.exit(f"test_groups: collecting the server tests failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return Counter(line.split("::", 1)[0] for line in proc.stdout.splitlines() if "::" in line)


def shards(counts: Counter[str], n: int) -> list[list[str]]:
    groups: list[list[str]] = [[] for _ in range(n)]
    loads = [0] * n
    for path, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        i = loads.index(min(loads))
        groups[i].append(path)
        loads[i] += count
    return [g for g in groups if g]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shards", type=int, default=5)
    parser.add_argument("--timeout", type=int, default=380, help="seconds per group")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    # The tools as make installs them (from the wheelhouse where PIP_NO_INDEX/PIP_FIND_LINKS say so).
    tools = subprocess.run(["make", *TOOLS], capture_output=True, text=True, check=False)
    if tools.returncode != 0:
        sys.exit(f"test_groups: make {' '.join(TOOLS)} failed:\n{tools.stdout[-3000:]}{tools.stderr[-3000:]}")
    pytest = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider"]
    groups: dict[str, tuple[str, list[str]]] = {
        "a": (f'-m "{UNIT}" tests/builder', ["-m", UNIT, "tests/builder"]),
        "b": (f'-m "{UNIT}" tests --ignore=tests/builder', ["-m", UNIT, "tests", "--ignore=tests/builder"]),
    }
    for i, files in enumerate(shards(server_files(), args.shards)):
        groups[f"c{i}"] = ('-m "server or slow" ' + " ".join(files), ["-m", "server or slow", *files])
    started = time.monotonic()
    running = {}
    for name, (_, selection) in groups.items():
        log = (args.out / f"test-{name}.log").open("w")
        running[name] = (subprocess.Popen(["timeout", str(args.timeout), *pytest, *selection], stdout=log,
                                          stderr=subprocess.STDOUT), log)
    def finish(name: str) -> tuple[int, float]:
        proc, log = running[name]
        code = proc.wait()
        log.close()
        return code, time.monotonic() - started

    with ThreadPoolExecutor(len(running)) as pool:
        ended = dict(zip(running, pool.map(finish, running), strict=True))
    rows = ["| group | selection | result | exit | seconds |", "|---|---|---|---|---|"]
    failed = False
    for name, (code, seconds) in ended.items():
        lines = [ln for ln in (args.out / f"test-{name}.log").read_text().splitlines() if ln.strip()]
        last = lines[-1] if lines else "(no output)"
        failed |= code != 0
        rows.append(f"| {name} | `{groups[name][0]}` | {last.strip('= ')} | {code} | {seconds:.0f} |")
    table = "\n".join(rows) + "\n"
    (args.out / "test-groups.md").write_text(table)
    print(table)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
