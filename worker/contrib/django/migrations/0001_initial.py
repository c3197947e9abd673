"""The unmanaged ``LedgerEntry``: Django's record of the model, no table (``managed=False``).

Shipped so that ``makemigrations`` in a project never writes one into site-packages.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies: list[tuple[str, str]] = []

    operations = [
        migrations.CreateModel(
            name="LedgerEntry",
            fields=[("key", models.CharField(max_length=64, primary_key=True, serialize=False))],
            options={
                "verbose_name": "ledger entry",
                "verbose_name_plural": "ledger entries",
                "db_table": "ledger_entries",
                "managed": False,
            },
        ),
    ]
