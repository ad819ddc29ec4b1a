"""systemd's readiness protocol (sd_notify(3)), for ``Type=notify`` units.

A handful of lines rather than a dependency: one datagram to the socket named
in ``NOTIFY_SOCKET`` (``@`` for Linux's abstract namespace). Without that
variable (not under systemd, or ``Type=simple``) every call does nothing.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("ckptfs.daemon")


def notify(*fields: str, environ: dict[str, str] | None = None) -> bool:
    """Send ``READY=1``, ``STATUS=...``, ``STOPPING=1`` ... as one message;
    whether it was sent. A failure is logged, never raised: systemd's view of
    the unit must not take the mount down."""
    address = (os.environ if environ is None else environ).get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(1.0)  # a datagram to a local socket; never a real wait
            sock.sendto("\n".join(fields).encode(), address)
    except OSError as exc:
        log.warning("could not tell systemd %s: %s", ", ".join(fields), exc)
        return False
    return True
