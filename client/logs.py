"""Logging for the command-line tools (both CLIs use it; library modules only log).

Our own packages log at INFO by default, DEBUG with -v, WARNING with -q. Third-party libraries
(ModelOpt, ONNX Runtime, onnxslim, urllib3, ...) reach the terminal only with warnings and errors,
and with everything at -vv.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence


def configure_logging(packages: Sequence[str], *, verbose: int, quiet: bool) -> None:
    # basicConfig adds its stderr handler only where none exists (an embedding program's stays).
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    ours = logging.WARNING if quiet else logging.DEBUG if verbose >= 1 else logging.INFO
    logging.getLogger().setLevel(logging.DEBUG if verbose >= 2 and not quiet else logging.WARNING)
    for name in packages:
        logging.getLogger(name).setLevel(ours)
