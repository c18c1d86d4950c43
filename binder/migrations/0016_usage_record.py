"""The usage record model moves from the usage app to the binder, which writes the records.

State only: the table keeps its name (``usage_usagerecord``), its rows, indexes,
constraints and the append-only trigger (usage migration 0002). The usage app keeps a
proxy of the same name (usage migration 0008) for its admin page and its permission.
"""

import django.core.validators
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('binder', '0015_lending'),
        ('usage', '0007_usage_record_borrowed'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='UsageRecord',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('namespace', models.CharField(max_length=63)),
                        ('subject_kind', models.CharField(choices=[('GPU', 'Gpu'), ('Pod', 'Pod')], max_length=8)),
                        ('subject', models.CharField(help_text='GPU device name, or pod name', max_length=253)),
                        ('subject_uid', models.CharField(blank=True, help_text='pod uid (empty for devices)', max_length=64)),
                        ('vm_name', models.CharField(blank=True, help_text="the device's VM (empty for pods)", max_length=253)),
                        ('key', models.CharField(help_text='class name for devices, raw resource name for pods', max_length=253)),
                        ('resource_name', models.CharField(max_length=253)),
                        ('units', models.PositiveIntegerField(validators=[django.core.validators.MinValueValidator(1)])),
                        ('node', models.CharField(blank=True, help_text='empty while Lost', max_length=253)),
                        ('phase', models.CharField(choices=[('Bound', 'Bound'), ('Lost', 'Lost'), ('Raw', 'Raw')], max_length=8)),
                        ('borrowed', models.BooleanField(default=False, help_text='held by a borrowed set (lending)')),
                        ('start', models.DateTimeField()),
                        ('end', models.DateTimeField(blank=True, help_text='empty while the record is open', null=True)),
                        ('opened_by_pass', models.BigIntegerField(blank=True, help_text='id of the full pass that opened it', null=True)),
                        ('closed_by_pass', models.BigIntegerField(blank=True, help_text='id of the full pass that closed it', null=True)),
                    ],
                    options={
                        'db_table': 'usage_usagerecord',
                        'ordering': ['start', 'id'],
                        'default_permissions': (),
                        'indexes': [models.Index(fields=['namespace', 'start'], name='usage_ns_start_idx'), models.Index(fields=['namespace', 'key', 'start'], name='usage_ns_key_idx'), models.Index(fields=['namespace', 'end'], name='usage_ns_end_idx')],
                        'constraints': [models.CheckConstraint(condition=models.Q(('units__gte', 1)), name='usage_units_positive'), models.CheckConstraint(condition=models.Q(('end__isnull', True), ('end__gte', models.F('start')), _connector='OR'), name='usage_end_after_start'), models.UniqueConstraint(condition=models.Q(('end__isnull', True)), fields=('namespace', 'subject_kind', 'subject', 'subject_uid', 'resource_name'), name='usage_one_open_per_subject')],
                    },
                ),
            ],
            database_operations=[],
        ),
    ]
