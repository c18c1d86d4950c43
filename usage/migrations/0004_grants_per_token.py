"""Grants per token: each of a user's tokens gets the user's grants it had
(nobody loses or gains access by the upgrade), then the grant names its token."""

import django.db.models.deletion
from django.db import migrations, models


def grants_per_token(apps, schema_editor):
    grant_model = apps.get_model("usage", "NamespaceGrant")
    token_model = apps.get_model("knox", "AuthToken")
    old = list(grant_model.objects.filter(token__isnull=True))
    rows = []
    for grant in old:
        for token in token_model.objects.filter(user_id=grant.user_id):
            rows.append(grant_model(user_id=grant.user_id, token=token, namespace=grant.namespace))
    grant_model.objects.filter(token__isnull=True).delete()
    grant_model.objects.bulk_create(rows)


class Migration(migrations.Migration):
    dependencies = [
        ("knox", "0009_extend_authtoken_field"),
        ("usage", "0003_window_index"),
    ]

    operations = [
        migrations.RemoveConstraint(model_name="namespacegrant", name="uniq_grant_per_user_namespace"),
        migrations.AddField(
            model_name="namespacegrant",
            name="token",
            field=models.ForeignKey(
                null=True, on_delete=django.db.models.deletion.CASCADE, related_name="namespace_grants",
                to="knox.authtoken",
            ),
        ),
        migrations.AddField(
            model_name="namespacegrant",
            name="namespace_uid",
            field=models.CharField(
                blank=True, help_text="the namespace's UID when granted (empty: not mirrored then)", max_length=64
            ),
        ),
        migrations.RunPython(grants_per_token, migrations.RunPython.noop),
    ]
