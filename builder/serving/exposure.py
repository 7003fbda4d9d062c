"""Where the bundled Triton listens, and the key its restricted APIs ask for once it leaves loopback.

By default every server we start (serve, tune's private ones, verify's, the tests') binds 127.0.0.1 for
HTTP, gRPC and metrics. Exposed on another address, the model-repository, shared-memory, logging and
trace APIs need the header `triton-admin-key: <key>` (Triton's `--http-restricted-api` and
`--grpc-restricted-protocol`, the same header the docker compose and Kubernetes files use; over gRPC
Triton expects it as `triton-grpc-protocol-triton-admin-key`).

The key. Triton 2.51 takes it only on its command line, and /proc/<pid>/cmdline is readable by every
local user. So the key is read from the environment (TRITON_ADMIN_KEY) or a file only its owner can
read (0600), never from our own command line; once Triton has parsed its options (it has opened its
log file) we overwrite the key's bytes in the server's argv through /proc/<pid>/mem (our own child,
same user: allowed). What stays visible: the key, for local users, between exec and that overwrite
(well under a second), and for good where the kernel refuses the write (a warning says so). Our own
record of the server (tritonserver.json) and our logs hold `<admin key>` in its place.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import secrets
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from builder.errors import ServerError
from client.admin_key import GRPC_KEY_HEADER as GRPC_KEY_HEADER  # re-exported: one name for both packages
from client.admin_key import KEY_ENV as KEY_ENV
from client.admin_key import KEY_HEADER as KEY_HEADER

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
KEY_FILE = "admin-key"  # in the state folder, when we make one
RESTRICTED = ("model-repository", "shared-memory", "logging", "trace")
HIDDEN = "<admin key>"
# Triton splits `<apis>:<header>=<value>` on ':' and '=': keep both out of the key, and anything a header
# value cannot hold.
_KEY = re.compile(r"[A-Za-z0-9._~+/-]{16,256}")
MAX_KEY_FILE = 4096


def check_address(address: str, flag: str = "--listen") -> str:
    """An IPv4 address literal (Triton binds exactly what it is given; names are not resolved here)."""
    try:
        return str(ipaddress.IPv4Address(address))
    except ValueError:
        raise ServerError(f"{flag} {address!r}: expected an IPv4 address such as 127.0.0.1, 0.0.0.0 (every "
                          "interface) or one of this host's addresses") from None


def is_loopback(address: str) -> bool:
    return ipaddress.IPv4Address(address).is_loopback


def probe_host(address: str) -> str:
    """Where we reach a server bound to `address` from this host (health checks, port checks)."""
    return LOOPBACK if address == "0.0.0.0" else address


def check_key(key: str, source: str) -> str:
    key = key.strip()
    if not _KEY.fullmatch(key):
        raise ServerError(f"{source}: the admin key must be 16-256 characters of A-Z a-z 0-9 . _ ~ + / - "
                          "(Triton splits its option on ':' and '=')")
    return key


def read_key_file(path: Path) -> str:
    """The key in `path`, which must be a regular file of ours that no one else can read or write."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ServerError(f"--admin-key-file {path}: cannot open ({exc.strerror or exc}; symlinks are "
                          "refused)") from exc
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ServerError(f"--admin-key-file {path}: not a regular file")
        if info.st_mode & 0o077:
            raise ServerError(f"--admin-key-file {path}: mode {stat.S_IMODE(info.st_mode):04o} lets others read "
                              f"or write it; chmod 600 {path}")
        if info.st_uid != os.getuid():
            raise ServerError(f"--admin-key-file {path}: owned by uid {info.st_uid}, not by you")
        data = handle.read(MAX_KEY_FILE + 1)
    if len(data) > MAX_KEY_FILE:
        raise ServerError(f"--admin-key-file {path}: over {MAX_KEY_FILE} bytes; expected one key")
    return check_key(data.decode("ascii", errors="replace"), f"--admin-key-file {path}")


def write_key_file(path: Path) -> str:
    """A new random key in a new 0600 file (created with that mode: never readable by others)."""
    key = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as handle:
        handle.write(key + "\n")
    return key


def client_key(key_file: Path | None = None, environ: dict[str, str] | None = None) -> str | None:
    """The key a client sends: --admin-key-file, else $TRITON_ADMIN_KEY, else none."""
    if key_file is not None:
        return read_key_file(key_file)
    value = (os.environ if environ is None else environ).get(KEY_ENV)
    return check_key(value, f"${KEY_ENV}") if value else None


@dataclass(frozen=True)
class Exposure:
    """The address Triton binds, and the admin key that guards the restricted APIs (None: unrestricted)."""

    address: str = LOOPBACK
    key: str | None = field(default=None, repr=False)

    @property
    def exposed(self) -> bool:
        return not is_loopback(self.address)

    @property
    def host(self) -> str:
        return probe_host(self.address)

    def args(self) -> list[str]:
        restrict = []
        if self.key is not None:
            apis = ",".join(RESTRICTED)
            restrict = [f"--http-restricted-api={apis}:{KEY_HEADER}={self.key}",
                        f"--grpc-restricted-protocol={apis}:{KEY_HEADER}={self.key}"]
        return [f"--http-address={self.address}", f"--grpc-address={self.address}",
                f"--metrics-address={self.address}", *restrict]

    def hide(self, argv: list[str]) -> list[str]:
        """argv as it may be recorded or logged: the key replaced."""
        return argv if self.key is None else [arg.replace(self.key, HIDDEN) for arg in argv]


def exposure(listen: str | None, *, restrict: bool = True, key_file: Path | None = None,
             state_dir: Path | None = None, environ: dict[str, str] | None = None) -> tuple[Exposure, str | None]:
    """The exposure `trtbuild serve` asks for, and where its key came from (None when unrestricted).

    Loopback (the default) needs no key. Another address is restricted unless `restrict` is False; the key
    is --admin-key-file's, else $TRITON_ADMIN_KEY, else a new random one written to STATE/admin-key (0600)."""
    address = check_address(listen) if listen is not None else LOOPBACK
    if is_loopback(address) or not restrict:
        return Exposure(address), None
    if key_file is not None:
        return Exposure(address, read_key_file(key_file)), f"--admin-key-file {key_file}"
    value = (os.environ if environ is None else environ).get(KEY_ENV)
    if value:
        return Exposure(address, check_key(value, f"${KEY_ENV}")), f"${KEY_ENV}"
    if state_dir is None:
        raise ServerError(f"--listen {address}: set {KEY_ENV} or --admin-key-file for the restricted APIs' key")
    path = state_dir / KEY_FILE
    return Exposure(address, write_key_file(path)), f"{path} (new, mode 0600)"


# --- the key out of the server's argv ---

def _arg_area(pid: int) -> tuple[int, int]:
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48 and 49 of proc(5)


def scrub_argv(pid: int, key: str) -> bool:
    """Overwrite every copy of `key` in pid's argv with '*' (the process's own parsed copy is elsewhere).
    True when none is left; False when the kernel refused (the key stays in /proc/<pid>/cmdline)."""
    secret = key.encode()
    try:
        start, end = _arg_area(pid)
        with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            area = mem.read(end - start)
            at = area.find(secret)
            while at >= 0:
                mem.seek(start + at)
                mem.write(b"*" * len(secret))
                at = area.find(secret, at + len(secret))
        return secret not in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError, IndexError) as exc:
        log.debug("cannot overwrite the admin key in pid %d's argv: %s", pid, exc)
        return False


def has_open(pid: int, path: Path) -> bool:
    """pid holds `path` open: Triton opens its --log-file only after parsing all its options (checked
    on 2.51: about 15 ms after exec), so this says the key has been copied out of argv."""
    want = str(path.resolve())
    try:
        return any(f.path == want for f in psutil.Process(pid).open_files())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def hide_key_once_parsed(pid: int, key: str, parsed: Callable[[], bool], exited: Callable[[], bool],
                         timeout: float = 60.0) -> bool:
    """Wait until the server has parsed its options (`parsed()`), then scrub the key from its argv.

    Scrubbing earlier would hand Triton the stars instead of the key. Returns scrub_argv's answer; False
    also when the server exited first or never showed it had parsed them (a warning names the risk)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not exited():
        if parsed():
            if scrub_argv(pid, key):
                return True
            break
        time.sleep(0.005)
    if not exited():
        log.warning("could not remove the admin key from tritonserver's command line (pid %d): local users "
                    "can read it in /proc/%d/cmdline while the server runs", pid, pid)
    return False
