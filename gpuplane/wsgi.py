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

from django.conf import settings

if settings.GPUPLANE_READ_MODEL_AT_START:
    # Each web process (gunicorn and granian import this module in every worker) builds its
    # read model of the mirror now, in a thread, so /readyz turns 200 before the first call.
    from binder.runtime.readmodel import build_in_background

    build_in_background()
