"""The process-wide setting the commands (perfclient, trtbuild) make before anything imports grpc: imported
first by the CLIs only, so that a program using the libraries keeps its own. (Here rather than in common: the
import must sort before client's own in client/cli.py.)

grpc-core logs each failed TLS handshake (and more) at INFO on stderr unless GRPC_VERBOSITY says otherwise
when grpc is first imported: a command's errors are its own one line (a user's GRPC_VERBOSITY is kept).
"""

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
