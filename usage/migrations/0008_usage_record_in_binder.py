"""The usage record model is the binder's now (binder migration 0016); this app keeps a proxy.

State only: the table, its rows and the permission ``usage.view_usagerecord`` (the proxy's
content type is the model's old one) stay as they were.
"""

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('binder', '0016_usage_record'),
        ('usage', '0007_usage_record_borrowed'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.DeleteModel(name='UsageRecord'),
                migrations.CreateModel(
                    name='UsageRecord',
                    fields=[],
                    options={'ordering': ['start', 'id'], 'proxy': True, 'indexes': [], 'constraints': []},
                    bases=('binder.usagerecord',),
                ),
            ],
            database_operations=[],
        ),
    ]
