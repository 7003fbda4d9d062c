"""Process-wide settings the commands (perfclient, trtbuild) make for themselves, imported by the CLIs only and
before anything imports grpc; a program that uses the libraries keeps its own settings.

grpc-core logs each failed TLS handshake (and more) at INFO on stderr unless GRPC_VERBOSITY says otherwise
when grpc is first imported: a command's errors are its own one line (a user's GRPC_VERBOSITY is kept).
"""

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
