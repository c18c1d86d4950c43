#!/usr/bin/env python
"""Django's command-line entry point for gpuplane."""

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpuplane.settings")
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line

    try:
        execute_from_command_line(sys.argv)
    except ImproperlyConfigured as exc:
        # A setting that does not parse: its name and value, not a traceback.
        sys.exit(f"gpuplane: cannot start: {exc}")


if __name__ == "__main__":
    main()
