"""Django-free Kubernetes: the kinds gpuplane reads, their parser, and the API client."""
