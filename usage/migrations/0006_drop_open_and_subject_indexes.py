"""Drop two usage-record indexes that no query needs: the one-open-record constraint's
partial index (namespace, subject_kind, subject, subject_uid, resource_name) WHERE end IS
NULL serves both the pass's open-record lookup by subject (what usage_subject_idx was for)
and a scan of the open records (usage_open_idx), and every index costs the COPY of a pass
that opens many records."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("usage", "0005_grant_token_required")]

    operations = [
        migrations.RemoveIndex(model_name="usagerecord", name="usage_subject_idx"),
        migrations.RemoveIndex(model_name="usagerecord", name="usage_open_idx"),
    ]
