"""Django-free Kubernetes: the kinds gpuplane reads, their parsers (the entry point ``objects``,
the core kinds ``core``, gpuplane's custom resources ``resources``, the shared field reading
``fields``) and the API client."""
