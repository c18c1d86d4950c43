"""What deploys gpuplane: the manifests (``base/``, ``overlays/``, ``demo/``, ``image/``) and the
servers' entry points and tools, each run from the repository root by path
(``gunicorn -c deploy/gunicorn.conf.py``, ``python deploy/webhook_server.py``...). A package so
that the import contracts (.importlinter) see it: it imports the product, the product none of it."""
