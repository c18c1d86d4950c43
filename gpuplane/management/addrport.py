"""Is the address ``make demo`` will serve on free? Asked before anything else happens.

The demo resets the database and prints a new login; a second ``make demo`` beside a
running one used to do both and only then fail on the port, leaving the first server
with a login that no longer worked. Binding the address first (and letting it go at
once) catches a taken port, a host that is not this machine's and a malformed address
while nothing is touched yet.
"""

from __future__ import annotations

import errno
import socket

from django.core.management.base import CommandError

HINT = "pick another with `make demo ADDRPORT=127.0.0.1:8001` (or `manage.py demo --addrport 127.0.0.1:8001`)"


def parse(addrport: str) -> tuple[str, int]:
    """``host:port``, ``[v6]:port`` or a bare ``port`` (runserver's forms) to ``(host, port)``."""
    host, sep, port = addrport.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", addrport
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise CommandError(f"--addrport {addrport!r}: the port must be a number from 1 to 65535; {HINT}")
    return host, int(port)


def ensure_free(addrport: str) -> None:
    """Raise a CommandError naming the address if it cannot be served on right now."""
    host, port = parse(addrport)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise CommandError(f"--addrport {addrport!r}: host {host!r} does not resolve ({exc}); {HINT}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        # as runserver binds it: SO_REUSEADDR, so a port in TIME_WAIT still counts as free
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                why = f"port {port} on {host} is already in use (another `make demo` or server?)"
            elif exc.errno == errno.EADDRNOTAVAIL:
                why = f"{host} is not an address of this machine"
            elif exc.errno == errno.EACCES:
                why = f"port {port} on {host} needs privileges this user does not have"
            else:
                why = f"cannot serve on {host}:{port}: {exc.strerror or exc}"
            raise CommandError(f"{why}; nothing was changed. Stop the other server or {HINT}.") from None
