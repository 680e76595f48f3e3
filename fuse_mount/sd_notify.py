"""Tell systemd how the daemon is doing (``Type=notify`` units), without linking libsystemd.

The protocol is one datagram of ``KEY=VALUE`` lines to the AF_UNIX socket named in
``$NOTIFY_SOCKET``; a name starting with ``@`` is in the abstract namespace. Outside systemd the
variable is unset and every call is a no-op, so the daemon calls these unconditionally.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Mapping

log = logging.getLogger(__name__)

NOTIFY_SOCKET = "NOTIFY_SOCKET"
"""The environment variable systemd sets for services that may notify it."""


def encode_state(fields: Mapping[str, str | int]) -> bytes:
    """``{"READY": 1, "STATUS": "..."}`` -> the datagram. Values are single lines by protocol."""
    lines = []
    for key, value in fields.items():
        text = str(value)
        if not key.isupper() or "=" in key or "\n" in text:
            raise ValueError(f"invalid sd_notify field {key}={text!r}")
        lines.append(f"{key}={text}")
    return ("\n".join(lines) + "\n").encode()


def socket_address(name: str) -> str | None:
    """``$NOTIFY_SOCKET`` -> an AF_UNIX address, or None for kinds we do not speak (vsock)."""
    if name.startswith("@"):
        return "\0" + name[1:]
    if name.startswith("/"):
        return name
    return None


def notify(env: Mapping[str, str] | None = None, **fields: str | int) -> bool:
    """Send ``fields`` to the service manager; False when there is none (or it is unreachable).

    A failure is logged, never raised: the daemon serves the mount just as well unsupervised.
    """
    name = (os.environ if env is None else env).get(NOTIFY_SOCKET, "")
    address = socket_address(name) if name else None
    if address is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(encode_state(fields), address)
    except OSError as exc:
        log.warning("cannot notify the service manager at %s: %s", name, exc)
        return False
    return True
