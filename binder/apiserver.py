"""Which API server gpuplane talks to: the settings' choice, or a test's override.

The client itself (``binder.kube.client``) is Django-free; this module reads the settings
(``GPUPLANE_CLUSTER``, ``GPUPLANE_KUBE_HOST``) and keeps the one connection per process.
"""

from __future__ import annotations

from functools import cache

from django.conf import settings
from kubernetes import client, config

from binder.kube.client import WRITERS, KubeApi

_override: KubeApi | None = None


def use(api: KubeApi | None) -> None:
    """Point gpuplane at a given API (tests: the test control plane); None goes back to the settings."""
    global _override
    _override = api
    connect.cache_clear()


@cache
def connect() -> KubeApi:
    """The API server of ``GPUPLANE_KUBE_HOST`` (tests, proxies), else in-cluster config,
    else the kubeconfig (``KUBECONFIG`` or ``~/.kube/config``)."""
    configuration = client.Configuration()
    if settings.GPUPLANE_KUBE_HOST:
        configuration.host = settings.GPUPLANE_KUBE_HOST
    else:
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            config.load_kube_config(client_configuration=configuration)
    # Kept connections: the client's default (5 per CPU) is below what one process has in
    # flight: a webhook server's threads, each writing a set's annotations several at once
    # (``kube_client.WRITERS``), or a pass's status writes beside the sync's. A connection
    # beyond the pool is opened and then dropped, paying a TLS handshake per call.
    configuration.connection_pool_maxsize = max(configuration.connection_pool_maxsize, 4 * WRITERS)
    return KubeApi(client.ApiClient(configuration))


def api() -> KubeApi:
    return _override if _override is not None else connect()


def cluster_mode() -> bool:
    return bool(settings.GPUPLANE_CLUSTER == "kubernetes")
