"""The start-up checks both servers make: the API's gunicorn and the webhook's granian.

``deploy/gunicorn.conf.py`` and ``deploy/webhook_server.py`` read their sizes and the TLS
files from the environment; one copy of the checks means one wording and one behaviour:
a size below 1 or not a number, one TLS file without the other, a path that is no file,
and cluster mode without TLS (the kube-apiserver calls admission webhooks over HTTPS only,
so a plain-HTTP server there would only make every VMI CREATE fail less obviously) all
stop the server before it binds, naming the variable. Nothing of Django: gunicorn loads its
config file before the application. The integers and yes/no settings are read with the
parsers ``gpuplane.settings`` reads its own with (``gpuplane/settings_parsers.py``), which
raise the same :class:`SettingError`.
"""

from __future__ import annotations

import os
from pathlib import Path

from gpuplane.settings_parsers import SettingError

CLUSTER_NEEDS_TLS = (
    "GPUPLANE_CLUSTER=kubernetes needs TLS: the kube-apiserver calls the VMI webhook over HTTPS only. "
    "Set GPUPLANE_TLS_CERT_FILE and GPUPLANE_TLS_KEY_FILE (e.g. /etc/gpuplane/tls/tls.crt and "
    "/etc/gpuplane/tls/tls.key from the mounted Secret; `manage.py webhook_cert` makes a development pair)."
)


#: The port both servers listen on with TLS when no bind address is set.
TLS_PORT = 8443


def existing_file(name: str) -> Path | None:
    """The file ``name`` names, None when unset; a path that is not a file is an error."""
    raw = os.environ.get(name, "")
    if not raw:
        return None
    path = Path(raw)
    if not path.is_file():
        raise SettingError(f"{name}={raw!r}: no such file")
    return path


def cluster_mode() -> bool:
    return (os.environ.get("GPUPLANE_CLUSTER") or "standalone") == "kubernetes"


def tls_files() -> tuple[Path, Path] | None:
    """The serving certificate and key (``GPUPLANE_TLS_CERT_FILE``, ``GPUPLANE_TLS_KEY_FILE``),
    both or neither; None for plain HTTP, which cluster mode refuses."""
    named = [os.environ.get(name, "") for name in ("GPUPLANE_TLS_CERT_FILE", "GPUPLANE_TLS_KEY_FILE")]
    if any(named) and not all(named):
        raise SettingError("set both GPUPLANE_TLS_CERT_FILE and GPUPLANE_TLS_KEY_FILE, or neither")
    cert, key = existing_file("GPUPLANE_TLS_CERT_FILE"), existing_file("GPUPLANE_TLS_KEY_FILE")
    if cert is None or key is None:
        if cluster_mode():
            raise SettingError(CLUSTER_NEEDS_TLS)
        return None
    return cert, key
