"""KubeVirt VirtualMachines mirrored (where a stopped VM may start: making room reads it), the
``gpuplane.io/keep-node`` annotation on GPUs, and a pass's making-room counts.

The new table joins the change feed with the triggers of 0008_change_feed (its SQL reused);
SQLite rebuilds the GPU table to add its NOT NULL column, dropping that table's triggers,
which are created again here (as in 0018_reason_codes).
"""

import importlib

import django.db.models.deletion
from django.db import migrations, models

#: The mirrored table this migration adds, with its feed kind and whether the row has a
#: namespace_id (as in 0008_change_feed's FEED_TABLES).
FEED_TABLES = (("binder_virtualmachine", "VirtualMachine", True),)
#: The mirrored table this migration adds a column to.
CHANGED_TABLES = (("binder_gpudevice", "GPU", True),)
#: 0008's trigger SQL, reused (a module name starting with a digit needs importlib).
_feed = importlib.import_module("binder.migrations.0008_change_feed")


def add_triggers(apps, schema_editor):  # noqa: ANN001 - Django's migration signature
    vendor = schema_editor.connection.vendor
    if vendor == "postgresql":
        statements = _feed._postgresql_sql(FEED_TABLES, with_feed=False)
    elif vendor == "sqlite":
        statements = _feed._sqlite_sql(FEED_TABLES)
    else:
        statements = []
    for sql in statements:
        schema_editor.execute(sql)


def drop_triggers(apps, schema_editor):  # noqa: ANN001 - Django's migration signature
    vendor = schema_editor.connection.vendor
    if vendor == "postgresql":
        statements = _feed._postgresql_reverse(FEED_TABLES, with_feed=False)
    elif vendor == "sqlite":
        statements = _feed._sqlite_reverse(FEED_TABLES)
    else:
        statements = []
    for sql in statements:
        schema_editor.execute(sql)


def _sqlite_device_triggers(apps, schema_editor):  # noqa: ANN001 - Django's migration signature
    """SQLite rebuilt the GPU table for its new NOT NULL column: its triggers went with the old
    table. PostgreSQL adds the column in place and keeps them."""
    if schema_editor.connection.vendor != "sqlite":
        return
    for sql in _feed._sqlite_reverse(CHANGED_TABLES) + _feed._sqlite_sql(CHANGED_TABLES):
        schema_editor.execute(sql)


class Migration(migrations.Migration):
    dependencies = [
        ("binder", "0019_gpu_admitted"),
    ]

    operations = [
        # Reversed last: removing the column rebuilds the table again.
        migrations.RunPython(migrations.RunPython.noop, _sqlite_device_triggers),
        migrations.AddField(
            model_name="gpudevice",
            name="keep_node",
            field=models.BooleanField(
                default=False, help_text='gpuplane.io/keep-node: "true": making room never moves this set off its node'
            ),
        ),
        migrations.RunPython(_sqlite_device_triggers, _sqlite_device_triggers),
        migrations.AddField(
            model_name="passrun",
            name="made_room",
            field=models.IntegerField(default=0, help_text="sets moved to make room for a waiting set (full passes)"),
        ),
        migrations.AddField(
            model_name="passrun",
            name="room_refused",
            field=models.IntegerField(
                default=0,
                help_text="waiting sets whose plan to make room GPUPLANE_MOVES_PER_PASS refused (full passes)",
            ),
        ),
        migrations.CreateModel(
            name="VirtualMachine",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("name", models.CharField(max_length=253)),
                ("uid", models.CharField(blank=True, max_length=64)),
                (
                    "node_selector",
                    models.JSONField(blank=True, default=dict, help_text="spec.template.spec.nodeSelector"),
                ),
                (
                    "affinity",
                    models.JSONField(
                        blank=True,
                        help_text="the template's required node affinity: its nodeSelectorTerms (null: none)",
                        null=True,
                    ),
                ),
                (
                    "tolerations",
                    models.JSONField(blank=True, default=list, help_text="spec.template.spec.tolerations"),
                ),
                ("created", models.DateTimeField(blank=True, null=True)),
                (
                    "parse_error",
                    models.TextField(
                        blank=True,
                        help_text="why the cluster's object stopped parsing; the row keeps its last good state",
                    ),
                ),
                (
                    "namespace",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="virtual_machines",
                        to="binder.namespace",
                    ),
                ),
            ],
            options={
                "verbose_name": "VirtualMachine",
                "ordering": ["namespace__name", "name"],
                "abstract": False,
                "indexes": [models.Index(fields=["name"], name="vm_name_idx")],
                "constraints": [models.UniqueConstraint(fields=("namespace", "name"), name="uniq_vm_per_namespace")],
            },
        ),
        migrations.RunPython(add_triggers, drop_triggers),
    ]
