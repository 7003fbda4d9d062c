"""Logging for the command-line tools (both CLIs use it; library modules only log).

Our own packages log at INFO by default, DEBUG with -v, WARNING with -q. Third-party libraries
(ModelOpt, ONNX Runtime, onnxslim, urllib3, ...) only reach the terminal with warnings and errors,
and with everything at -vv.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence


def configure_logging(packages: Sequence[str], *, verbose: int, quiet: bool) -> None:
    ours = logging.WARNING if quiet else logging.DEBUG if verbose >= 1 else logging.INFO
    others = logging.DEBUG if verbose >= 2 and not quiet else logging.WARNING
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(others)
    for name in packages:
        logging.getLogger(name).setLevel(ours)
