"""The non-blocking check of `make test-latest`: the newest versions pyproject.toml's ranges admit, against the lock.

Installs the project from its ranges (no lock) into a separate virtualenv, prints the packages whose versions
differ from the locked environment, runs the fast test tier in both environments and prints every test whose
outcome differs. Exit status: 0 when no test changed outcome, 1 when one did, 2 when the check itself could not
run. CI does not run it; it tells whoever refreshes the lock (`make lock`) what a refresh would change.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAST_TIER = "not server and not slow"
_VERSIONS = ("import importlib.metadata as m, json; "
             "print(json.dumps({d.metadata['Name'].lower().replace('_', '-'): d.version for d in m.distributions()}))")


def _run(command: list[str], *, timeout: float) -> None:
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=ROOT, timeout=timeout)


def versions(python: Path) -> dict[str, str]:
    out = subprocess.run([str(python), "-c", _VERSIONS], check=True, capture_output=True, text=True, timeout=120)
    found: dict[str, str] = json.loads(out.stdout)
    return found


def install_latest(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(venv)], timeout=300)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run([*pip, "--upgrade", "pip", "setuptools>=77"], timeout=900)
    _run([*pip, "--upgrade", "--upgrade-strategy", "eager", "-e", ".[dev]"], timeout=1800)
    _run([*pip, "--no-deps", "nvidia-pytriton==0.7.0"], timeout=900)
    return python


def outcomes(junit: Path) -> dict[str, str]:
    """test id -> passed / failed / error / skipped, from a pytest JUnit XML file."""
    result: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        result[name] = next((k for k in ("error", "failure", "skipped") if k in kinds), "passed")
    return result


def run_tier(python: Path, junit: Path, marker: str) -> dict[str, str]:
    command = [str(python), "-m", "pytest", "-q", "-m", marker, "-p", "no:cacheprovider", f"--junitxml={junit}",
               "tests"]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, cwd=ROOT, timeout=3600, check=False)  # failures are the result, not an error
    if not junit.exists():
        raise RuntimeError(f"pytest under {python} wrote no {junit}")
    return outcomes(junit)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--locked-python", type=Path, required=True, help="the locked environment's python")
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv-latest", help="where to install the newest")
    parser.add_argument("--marker", default=FAST_TIER, help=f"pytest -m expression (default: {FAST_TIER!r})")
    args = parser.parse_args(argv)
    if not args.locked_python.exists():
        print(f"test-latest: {args.locked_python}: no such interpreter (expected the locked .venv; run "
              "`make install`)", file=sys.stderr)
        return 2
    try:
        latest_python = install_latest(args.venv)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        print(f"test-latest: installing the newest versions failed: {exc}", file=sys.stderr)
        return 2
    locked, latest = versions(args.locked_python), versions(latest_python)
    changed = sorted(n for n in set(locked) | set(latest) if locked.get(n) != latest.get(n))
    print(f"\n{len(changed)} package(s) differ from the lock:")
    for name in changed:
        print(f"  {name:32} {locked.get(name, 'absent'):>14} -> {latest.get(name, 'absent')}")
    with tempfile.TemporaryDirectory() as tmp:
        before = run_tier(args.locked_python, Path(tmp) / "locked.xml", args.marker)
        after = run_tier(latest_python, Path(tmp) / "latest.xml", args.marker)
    moved = sorted(t for t in set(before) | set(after) if before.get(t) != after.get(t))
    print(f"\n{len(before)} tests under the lock, {len(after)} under the newest; {len(moved)} changed outcome:")
    for test in moved:
        print(f"  {before.get(test, 'absent'):>8} -> {after.get(test, 'absent'):8} {test}")
    return 1 if moved else 0


if __name__ == "__main__":
    raise SystemExit(main())
