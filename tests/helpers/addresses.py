"""A name that resolves to several loopback addresses, on the running event loop: how `localhost` behaves
where it means both ::1 and 127.0.0.1, without depending on this machine's resolver."""

from __future__ import annotations

import asyncio
import socket
from typing import Any


def resolve_every_name_to(*addresses: str) -> None:
    """Make the running loop resolve any host to `addresses` (IPv4), in that order."""
    async def getaddrinfo(host: str, port: int, **kwargs: Any) -> list[Any]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port)) for address in addresses]

    asyncio.get_running_loop().getaddrinfo = getaddrinfo  # type: ignore[method-assign,assignment]
