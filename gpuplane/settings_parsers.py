"""How a setting is read from the environment, in one place for the settings and the servers.

``gpuplane.settings`` reads its integers and yes/no settings through these parsers, and the two
servers' start-up checks (``deploy/serving.py``, for ``deploy/gunicorn.conf.py`` and
``deploy/webhook_server.py``) read their sizes and switches through the same ones: one wording
and one behaviour for a size below its minimum or not a number, and for a yes/no that is
neither. Standard library only, and nothing of Django: gunicorn loads its config file, which
imports this, before any of the application is loaded (the ``gpuplane`` package brings its Celery
app along, which reads no setting until it is used).
"""

from __future__ import annotations

import os


class SettingError(RuntimeError):
    """A setting gpuplane cannot start with; the message names the variable."""


def positive_int(name: str, default: int, minimum: int = 1) -> int:
    """``name`` as an integer of at least ``minimum`` (``default`` when unset or empty)."""
    raw = os.environ.get(name) or str(default)
    try:
        value = int(raw)
    except ValueError:
        raise SettingError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise SettingError(f"{name}={raw!r} must be at least {minimum}")
    return value


#: The spellings a yes/no setting takes.
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def boolean(name: str, default: bool) -> bool:
    """``name`` as true or false (``default`` when unset or empty)."""
    raw = os.environ.get(name) or ""
    value = raw.strip().lower()
    if not value:
        return default
    if value in TRUE_WORDS:
        return True
    if value in FALSE_WORDS:
        return False
    raise SettingError(f"{name}={raw!r} is not a boolean (use true or false)")
