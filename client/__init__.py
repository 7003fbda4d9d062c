"""perfclient: load generator and meter for Triton (latency, throughput, watts, joules per inference)."""

import logging
import os

# grpc-core logs each failed TLS handshake (and more) at INFO on stderr, unless told otherwise before grpc is
# imported: perfclient's errors are its own one line (a user's GRPC_VERBOSITY is kept).
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

__version__ = "0.1.0"

logger = logging.getLogger("client")
logger.addHandler(logging.NullHandler())
