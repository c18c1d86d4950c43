"""gunicorn configuration for gpuplane's web process (the API, the admin and the VMI webhook).

Run it with ``gunicorn -c deploy/gunicorn.conf.py gpuplane.wsgi`` (``make serve-tls``).
Everything comes from the environment, so one file serves every deployment:

``GPUPLANE_TLS_CERT_FILE`` / ``GPUPLANE_TLS_KEY_FILE``
    Paths of the serving certificate and key, normally the mounted Secret
    (``/etc/gpuplane/tls/tls.crt`` and ``tls.key``). With both set gunicorn serves HTTPS
    on 0.0.0.0:8443; with neither, plain HTTP on 0.0.0.0:8000.
``GPUPLANE_BIND``
    Overrides the bind address (for tests and local runs, e.g. ``127.0.0.1:9443``).
``GPUPLANE_WEB_WORKERS`` / ``GPUPLANE_WEB_THREADS``
    Worker processes (default 2) and threads per worker (default 8).

The kube-apiserver calls admission webhooks over HTTPS only, so in cluster mode
(``GPUPLANE_CLUSTER=kubernetes``) the server refuses to start without the TLS files
rather than serve a webhook the apiserver cannot reach (every VMI CREATE would then
fail under ``failurePolicy: Fail`` with a less obvious error).

Workers are threaded (``gthread``): a webhook call can wait up to
``GPUPLANE_BIND_WAIT_SECONDS`` (8 s) for the binder's answer, and a synchronous worker
would hold its whole process for that long. ``timeout`` (the worker heartbeat) stays
well above the webhook's 10 s ``timeoutSeconds``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# gunicorn loads this file by path, before the application: the repository root makes
# deploy/serving.py (the checks the webhook server makes too) and gpuplane's setting parsers
# importable.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from deploy.serving import TLS_PORT, tls_files  # noqa: E402
from gpuplane.settings_parsers import positive_int  # noqa: E402

PLAIN_PORT = 8000

_tls = tls_files()
if _tls is not None:
    certfile, keyfile = (str(path) for path in _tls)

bind = [os.environ.get("GPUPLANE_BIND") or f"0.0.0.0:{TLS_PORT if _tls else PLAIN_PORT}"]
workers = positive_int("GPUPLANE_WEB_WORKERS", 2)
worker_class = "gthread"
threads = positive_int("GPUPLANE_WEB_THREADS", 8)
#: Worker heartbeat timeout: far above the webhook's 10 s timeoutSeconds.
timeout = 30
graceful_timeout = 20
#: The apiserver keeps connections to webhooks open between calls.
keepalive = 30
#: No gunicornc control socket: by default it lives at ~/.gunicorn/gunicorn.ctl, which a
#: non-root pod may not be able to create, and two servers on one host would share it.
control_socket_disable = True
accesslog = "-"
errorlog = "-"
