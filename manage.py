#!/usr/bin/env python3
"""Django's command-line entry point for gpuplane."""

import os
import sys
from pathlib import Path


def _in_the_projects_venv() -> None:
    """``./manage.py`` runs the first ``python3`` on the PATH, which on a fresh machine is
    the system's, without Django: run again with the project's ``.venv`` (made by ``make``)
    instead of failing with "No module named 'django'"."""
    venv_python = Path(__file__).resolve().parent / ".venv" / "bin" / "python"
    if Path(sys.prefix).resolve() == venv_python.parent.parent.resolve():
        return  # already the venv: Django is missing from it, the import below says so
    if venv_python.exists():
        os.execv(venv_python, [str(venv_python), __file__, *sys.argv[1:]])  # noqa: S606 - our own venv
    sys.exit(
        f"gpuplane: Django is not installed for {sys.executable} and there is no .venv yet: "
        "run `make .venv/.dev` (or `make demo`) first"
    )


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpuplane.settings")
    try:
        import django  # noqa: F401
    except ModuleNotFoundError:
        _in_the_projects_venv()
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line

    try:
        execute_from_command_line(sys.argv)
    except ImproperlyConfigured as exc:
        # A setting that does not parse: its name and value, not a traceback.
        sys.exit(f"gpuplane: cannot start: {exc}")


if __name__ == "__main__":
    main()
