"""perfclient: load generator and meter for Triton (latency, throughput, watts, joules per inference)."""

import logging

__version__ = "0.1.0"

logger = logging.getLogger("client")
logger.addHandler(logging.NullHandler())
