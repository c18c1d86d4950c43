"""On PostgreSQL, make usage records append-only in the database itself.

The model and queryset already refuse to edit a closed record or delete any record;
this trigger also stops raw SQL and other clients: an UPDATE of a closed record, an
UPDATE of an open record that changes anything but ``end`` and ``closed_by_pass``, a
reopening, and every DELETE raise. (TRUNCATE, a table-level operation for operators,
is not affected.) SQLite, the embedded default, relies on the model checks alone.
"""

from django.db import migrations

CREATE = r"""
CREATE OR REPLACE FUNCTION usage_record_append_only() RETURNS trigger AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'usage record % cannot be deleted: usage records are append-only', OLD.id
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    IF OLD."end" IS NOT NULL THEN
        RAISE EXCEPTION 'usage record % is closed and cannot be changed', OLD.id
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    IF NEW."end" IS NULL AND NEW.closed_by_pass IS DISTINCT FROM OLD.closed_by_pass THEN
        RAISE EXCEPTION 'usage record %: closed_by_pass may only be set when closing', OLD.id
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    IF (NEW.id, NEW.namespace, NEW.subject_kind, NEW.subject, NEW.subject_uid, NEW.vm_name, NEW.key,
        NEW.resource_name, NEW.units, NEW.node, NEW.phase, NEW.start, NEW.opened_by_pass)
       IS DISTINCT FROM
       (OLD.id, OLD.namespace, OLD.subject_kind, OLD.subject, OLD.subject_uid, OLD.vm_name, OLD.key,
        OLD.resource_name, OLD.units, OLD.node, OLD.phase, OLD.start, OLD.opened_by_pass) THEN
        RAISE EXCEPTION 'usage record %: only end and closed_by_pass may change', OLD.id
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;
DROP TRIGGER IF EXISTS usage_record_append_only ON usage_usagerecord;
CREATE TRIGGER usage_record_append_only BEFORE UPDATE OR DELETE ON usage_usagerecord
    FOR EACH ROW EXECUTE FUNCTION usage_record_append_only();
"""

DROP = """
DROP TRIGGER IF EXISTS usage_record_append_only ON usage_usagerecord;
DROP FUNCTION IF EXISTS usage_record_append_only();
"""


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE, params=None)


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP, params=None)


class Migration(migrations.Migration):
    dependencies = [("usage", "0001_initial")]

    operations = [migrations.RunPython(create, drop)]
