from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("binder", "0008_change_feed"),
    ]

    operations = [
        migrations.AddField(
            model_name="passrun",
            name="triggered_by",
            field=models.CharField(
                blank=True,
                help_text=(
                    "what asked for the pass: event, resync, answer, overdue, webhook, command, direct or staff:<user>;"
                    " a request collapsed into a pass already queued leaves the first one's (blank: before this was kept)"
                ),
                max_length=160,
            ),
        ),
    ]
