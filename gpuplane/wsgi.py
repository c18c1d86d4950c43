"""WSGI entry point (gunicorn ``gpuplane.wsgi``)."""

import os
import sys

from django.core.exceptions import ImproperlyConfigured
from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpuplane.settings")

try:
    application = get_wsgi_application()
except ImproperlyConfigured as exc:  # a setting that does not parse: name and value, no traceback
    sys.exit(f"gpuplane: cannot start: {exc}")
