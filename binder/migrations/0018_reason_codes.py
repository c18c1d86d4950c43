"""Reason codes beside the reasons: what code switches on, so nothing reads a reason's words.

Existing rows get the codes the binder switches on, read once here from the words the
binder wrote before it kept codes (the only place the words are read): a Lost set's
first reason, a set waiting for reclaim, a released set, a missing class. Every other
row keeps an empty code until its next reason is written.
"""

import importlib

from django.db import migrations, models

#: The mirrored table this migration adds a column to, with its feed kind and whether the
#: row has a namespace_id (as in 0008_change_feed's FEED_TABLES).
CHANGED_TABLES = (("binder_gpudevice", "GPU", True),)
#: 0008's trigger SQL, reused (a module name starting with a digit needs importlib).
_feed = importlib.import_module("binder.migrations.0008_change_feed")

#: (code, phase or None for any, what the reason starts with, what it contains), in order:
#: a later match wins, so a Lost reason with a reclaim note is WaitsForReclaim.
BACKFILL = (
    ("Lost", "Lost", "lost:", ""),
    ("Released", "Pending", "pending: released: ", ""),
    ("ClassMissing", "Pending", "pending: class ", " does not exist"),
    ("WaitsForReclaim", None, "", "; waits for reclaim: "),
)


def backfill(apps, schema_editor):  # noqa: ANN001 - Django's migration signature
    device = apps.get_model("binder", "GpuDevice")
    for code, phase, starts, contains in BACKFILL:
        rows = device.objects.all()
        if phase is not None:
            rows = rows.filter(phase=phase)
        if starts:
            rows = rows.filter(reason__startswith=starts)
        if contains:
            rows = rows.filter(reason__contains=contains)
        rows.update(reason_code=code)


def _sqlite_triggers(apps, schema_editor):  # noqa: ANN001 - Django's migration signature
    """SQLite cannot add a NOT NULL column in place: Django rebuilds the table, and the old
    table's triggers go with it (see 0015_lending). Re-created here; PostgreSQL adds the
    column in place and keeps its triggers."""
    if schema_editor.connection.vendor != "sqlite":
        return
    for sql in _feed._sqlite_reverse(CHANGED_TABLES) + _feed._sqlite_sql(CHANGED_TABLES):
        schema_editor.execute(sql)


class Migration(migrations.Migration):
    dependencies = [
        ("binder", "0017_mirror_name_indexes"),
    ]

    operations = [
        # Reversed last: removing the column rebuilds the table again.
        migrations.RunPython(migrations.RunPython.noop, _sqlite_triggers),
        migrations.AddField(
            model_name="decision",
            name="reason_code",
            field=models.CharField(blank=True, default="", help_text="the reason's code", max_length=32),
        ),
        migrations.AddField(
            model_name="gpudevice",
            name="reason_code",
            field=models.CharField(
                blank=True,
                default="",
                help_text="what kind of reason it is (binder.engine.reasons.Code): what code switches on, never the words",
                max_length=32,
            ),
        ),
        migrations.RunPython(_sqlite_triggers, _sqlite_triggers),
        migrations.RunPython(backfill, migrations.RunPython.noop),
    ]
