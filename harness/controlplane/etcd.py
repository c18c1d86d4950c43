"""etcd for the control plane: its data in memory (``/dev/shm``) and ``--unsafe-no-fsync``
(nothing here must survive a crash), on two free loopback ports, and calls to its JSON gateway
(``/v3/kv/...``), which the resets and the compaction fault use."""

from __future__ import annotations

import base64
import json
import urllib.request
from pathlib import Path
from typing import Any

from harness.controlplane.processes import Process
from harness.ports import free_port


class Etcd:
    """One etcd member, ``gpuplane-test``, its data under ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.port, self.peer_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def process(self, binary: Path) -> Process:
        return Process(
            "etcd",
            [
                str(binary), "--name=gpuplane-test", f"--data-dir={self.dir / 'etcd'}",
                f"--listen-client-urls={self.url}", f"--advertise-client-urls={self.url}",
                f"--listen-peer-urls=http://127.0.0.1:{self.peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{self.peer_port}",
                f"--initial-cluster=gpuplane-test=http://127.0.0.1:{self.peer_port}",
                "--unsafe-no-fsync", "--log-level=warn", "--quota-backend-bytes=2147483648",
            ],
            self.dir / "etcd.log",
        )  # fmt: skip

    def healthy(self) -> bool:
        with urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer:  # noqa: S310 - loopback
            return bool(json.loads(answer.read()).get("health") == "true")

    def call(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        """One call to etcd's JSON gateway (``/v3/kv/...``)."""
        call = urllib.request.Request(  # noqa: S310 - loopback
            f"{self.url}/v3/{method}", data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(call, timeout=10) as answer:  # noqa: S310
            return dict(json.loads(answer.read()))

    def revision(self) -> int:
        """etcd's current revision (a resourceVersion newer than every object's)."""
        return int(self.call("kv/range", {"key": base64.b64encode(b"/").decode()})["header"]["revision"])

    def compact(self) -> int:
        """Compact etcd at its current revision, physically: a watch from any older
        resourceVersion is answered 410 Gone (the apiserver itself compacts every 5 min)."""
        revision = self.revision()
        self.call("kv/compaction", {"revision": str(revision), "physical": True})
        return revision


def prefix_range(prefix: str) -> dict[str, str]:
    """etcd's [key, range_end) for every key with ``prefix``."""
    raw = prefix.encode()
    end = raw[:-1] + bytes([raw[-1] + 1])
    return {"key": base64.b64encode(raw).decode(), "range_end": base64.b64encode(end).decode()}
