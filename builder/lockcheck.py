"""Compare the installed packages with a lock file and print one line when they differ.

`make install` and `make engines` run it: the README's figures and build.json's recorded outcomes were
measured with the locked versions, so a user running other versions is told which, once, up front.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# `make install` alone does nothing once its stamp exists, whatever was changed in .venv since.
RESTORE = "rm .venv/.installed && make install"
_PYTHON = re.compile(r"--python-version[ =](\d+\.\d+)")  # in uv's header: the Python the lock was resolved for
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked_versions(lock: Path) -> dict[str, str]:
    """`name==version` pins of a pip requirements lock (hash and comment lines skipped)."""
    pins: dict[str, str] = {}
    for line in lock.read_text(encoding="utf-8").splitlines():
        match = _PIN.match(line.strip())
        if match:
            pins[_normalized(match.group(1))] = match.group(2)
    return pins


def names_file(path: Path) -> set[str]:
    """Normalized distribution names of a file of one name a line (`#` comments and blank lines skipped)."""
    names = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(_normalized(line))
    return names


def without(lock_text: str, names: set[str]) -> str:
    """The lock's text less the pins of `names`: each pin's block (its hash and `# via` lines) goes with it."""
    kept, skipping = [], False
    for line in lock_text.splitlines(keepends=True):
        if line[:1] not in (" ", "\t"):  # a line at column 0 starts a pin's block or is a comment of the file's own
            match = _PIN.match(line)
            skipping = match is not None and _normalized(match.group(1)) in names
        if not skipping:
            kept.append(line)
    return "".join(kept)


def lock_python(lock: Path) -> str | None:
    """The Python version (3.11) the lock was resolved for, from uv's header; None when it names none."""
    for line in lock.read_text(encoding="utf-8").splitlines()[:10]:
        match = _PYTHON.search(line)
        if match:
            return match.group(1)
    return None


def installed_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


# Distributions that install the same module: `make install-gpu` removes the CPU onnxruntime that lock-gpu.txt
# also pins (a dependency asks for it) and keeps onnxruntime-gpu, which stands in for it at the same version.
_STANDS_IN = {"onnxruntime": "onnxruntime-gpu"}


def differences(pins: dict[str, str],
                installed_of: Callable[[str], str | None] = installed_version) -> list[tuple[str, str, str | None]]:
    """(name, locked, installed or None) for every pin the environment does not match."""
    found = []
    for name, locked in sorted(pins.items()):
        installed = installed_of(name)
        stand_in = _STANDS_IN.get(name)
        if stand_in is not None and pins.get(stand_in) == locked:
            theirs = installed_of(stand_in)
            # The stand-in at the locked version is what imports; a GPU host's own CPU onnxruntime, found through
            # the host-torch path after the venv's packages, is not.
            if installed is None or theirs == locked:
                installed = theirs
        # A local label on the lock's side only (torch 2.13.0+cpu) is the same release when metadata drops it.
        if installed is None or (installed != locked and installed != locked.split("+", 1)[0]):
            found.append((name, locked, installed))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m builder.lockcheck", description=__doc__)
    parser.add_argument("lock", type=Path, help="a pip lock file (requirements/lock.txt)")
    parser.add_argument("--what", default="tools", help="word used in the message (default: tools)")
    parser.add_argument("--python-only", action="store_true",
                        help="only check that this Python is the one the lock was resolved for (status 1 if not)")
    parser.add_argument("--without", type=Path, metavar="NAMES",
                        help="write the lock less the distributions this file names (one a line) to --output")
    parser.add_argument("--output", type=Path, help="where --without writes the lock it makes")
    args = parser.parse_args(argv)
    if not args.lock.is_file():
        print(f"lockcheck: {args.lock}: no such lock file (expected requirements/lock.txt from the checkout)",
              file=sys.stderr)
        return 1
    if args.without is not None:
        if args.output is None:
            parser.error("--without needs --output")
        args.output.write_text(without(args.lock.read_text(encoding="utf-8"), names_file(args.without)),
                               encoding="utf-8")
        return 0
    if args.python_only:
        # Its wheels (torch's one hash, packages for older Pythons left out) fit that Python only: elsewhere
        # pip fails with a resolver error that does not say why.
        want, have = lock_python(args.lock), f"{sys.version_info.major}.{sys.version_info.minor}"
        if want is not None and want != have:
            print(f"lockcheck: {args.lock} is resolved for Python {want}; {sys.prefix} runs Python {have}. "
                  f"Remove it and run `make install PYTHON=python{want}`", file=sys.stderr)
            return 1
        return 0
    diff = differences(locked_versions(args.lock))
    if diff:
        shown = ", ".join(f"{name} {installed or 'absent'} (locked {locked})" for name, locked, installed in diff[:8])
        more = f" and {len(diff) - 8} more" if len(diff) > 8 else ""
        print(f"note: {args.what} differ from {args.lock} (the documented figures were measured with the locked "
              f"versions; `{RESTORE}` restores them): {shown}{more}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
