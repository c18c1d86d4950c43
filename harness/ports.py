"""Free loopback ports, reserved until the process that asked for them exits.

The harness and the benches start servers on ports they choose beforehand (etcd, kube-apiserver,
the webhook server, gunicorn, virt-controller, kwok...): the port goes on the command line and
the server binds it a moment later. Binding port 0, reading the number and closing leaves a
race in that moment: the kernel hands the same ephemeral ports to every process's port-0 binds
and outgoing connections, so another pytest-xdist worker, another suite on this machine or a
client connection can take the port before the server binds it. controller-runtime's envtest
closes that race by reserving each port it suggests (``pkg/internal/testing/addr``); so does
:func:`free_port`:

- a port is chosen below the kernel's ephemeral range (``ip_local_port_range``), where no
  port-0 bind and no outgoing connection is ever given one, and from 20000 up, above the
  services' usual ports;
- it must be free now (a bind to 127.0.0.1 succeeds, without ``SO_REUSEADDR``: a port still in
  TIME_WAIT is passed over);
- and it is written into a table every process of this user on this machine shares (a JSON file
  in the temporary directory, read and written under an exclusive ``flock``), with the asking
  process's id. No other caller is given a port while the process that reserved it runs (a day
  at most, against a reused process id); the server it was meant for has bound it long before.

Standard library only: ``.ci/clean-venv-smoke`` and ``.ci/image`` take a port from
``python -m harness.ports``, which prints one. Its reservation ends with that command, but the
port is still outside the ephemeral range and not one a running process holds reserved.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

#: The lowest port handed out: above PostgreSQL, Redis, the demo's 8000 and the TLS 8443.
FLOOR = 20000
#: The kernel's default ephemeral range, when /proc does not say.
DEFAULT_EPHEMERAL = (32768, 60999)
#: A reservation whose process still runs lapses after this long (the process id may be reused).
MAX_AGE_SECONDS = 24 * 3600
#: The shared table: {port: [process id, time reserved]}.
TABLE = Path(tempfile.gettempdir()) / f"gpuplane-ports-{os.getuid()}.json"

_random = random.Random()  # spreading picks, not secrecy


def free_port() -> int:
    """A loopback port free now and reserved for this process (see the module's docstring)."""
    candidates = _candidates()
    with _locked_table() as table:
        now = time.time()
        for key, held in list(table.items()):
            if not _holds(held, now):
                del table[key]
        taken = {int(key) for key in table}
        for _ in range(1000):
            port = _random.choice(candidates)
            if port not in taken and _bindable(port):
                table[str(port)] = [os.getpid(), now]
                return port
            taken.add(port)
    raise RuntimeError(f"no free loopback port in {candidates.start}-{candidates.stop - 1} after 1000 tries")


def _candidates() -> range:
    """The ports to choose from: below the ephemeral range, else above it, else any."""
    low, high = DEFAULT_EPHEMERAL
    with contextlib.suppress(OSError, ValueError):
        low, high = (int(n) for n in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    if low - FLOOR >= 1000:
        return range(FLOOR, low)
    if 65535 - high >= 1000:
        return range(max(high + 1, FLOOR), 65536)
    return range(FLOOR, 65536)


@contextlib.contextmanager
def _locked_table() -> Iterator[dict[str, object]]:
    """The shared table, read and written back under an exclusive lock."""
    lock = TABLE.with_suffix(".lock")
    with lock.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            try:
                table = json.loads(TABLE.read_text())
            except (OSError, ValueError):
                table = {}
            if not isinstance(table, dict) or not all(str(p).isdigit() for p in table):
                table = {}
            yield table
            scratch = TABLE.with_suffix(f".{os.getpid()}.tmp")
            scratch.write_text(json.dumps(table))
            scratch.replace(TABLE)
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _holds(held: object, now: float) -> bool:
    """Whether a table entry still reserves its port: its process runs and it is under a day old."""
    if not isinstance(held, list) or len(held) != 2:
        return False
    try:
        pid, since = int(held[0]), float(held[1])
    except (TypeError, ValueError):
        return False
    if now - since >= MAX_AGE_SECONDS:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: running
    return True


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


if __name__ == "__main__":
    print(free_port())
