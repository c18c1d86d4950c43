"""Grants per token, second step: every grant names its token (a migration of its own, so
PostgreSQL commits 0004's rows before the column is altered)."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("usage", "0004_grants_per_token")]

    operations = [
        migrations.AlterField(
            model_name="namespacegrant",
            name="token",
            field=models.ForeignKey(
                on_delete=django.db.models.deletion.CASCADE, related_name="namespace_grants", to="knox.authtoken"
            ),
        ),
        migrations.AlterModelOptions(
            name="namespacegrant", options={"ordering": ["user__username", "namespace", "created"]}
        ),
        migrations.AddConstraint(
            model_name="namespacegrant",
            constraint=models.UniqueConstraint(fields=("token", "namespace"), name="uniq_grant_per_token_namespace"),
        ),
    ]
