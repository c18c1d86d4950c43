"""docs/settings.md lists exactly the environment variables the product reads.

The table cannot drift from the code: the variables are found in the source of
``gpuplane/settings.py`` and of the servers' start-up (``deploy/serving.py``,
``deploy/gunicorn.conf.py``, ``deploy/webhook_server.py``) as the string literals their
readers take (``os.environ.get("X")``, ``env_int("X", ...)``; ``env_secret("X")`` also
reads ``X_FILE``), and compared with the first column of the table, both ways.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("gpuplane/settings.py", "deploy/serving.py", "deploy/gunicorn.conf.py", "deploy/webhook_server.py")
VARIABLE = re.compile(r"(GPUPLANE|DJANGO|CELERY)_[A-Z0-9_]+|DATABASE_URL")
#: Set for Django itself by every entry point, not a setting of the product.
NOT_SETTINGS = {"DJANGO_SETTINGS_MODULE"}


def variables_read() -> set[str]:
    found: set[str] = set()
    for source in SOURCES:
        tree = ast.parse((ROOT / source).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and VARIABLE.fullmatch(node.value):
                found.add(node.value)
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "env_secret"
                and isinstance(node.args[0], ast.Constant)
            ):
                found.add(f"{node.args[0].value}_FILE")
    return found - NOT_SETTINGS


def variables_documented() -> list[str]:
    text = (ROOT / "docs" / "settings.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    return [name for row in rows for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", row.split("|")[1])]


def test_every_variable_the_code_reads_has_one_row_and_every_row_is_read() -> None:
    documented = variables_documented()
    assert len(documented) == len(set(documented)), "a variable has two rows"
    read = variables_read()
    assert len(read) > 40  # the finder finds them (a broken finder would pass an empty table)
    assert sorted(read - set(documented)) == [], "read by the code, missing in docs/settings.md"
    assert sorted(set(documented) - read) == [], "in docs/settings.md, read by nothing"
