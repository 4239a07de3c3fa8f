from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("jobs", "0008_layout_help_text"),
    ]

    operations = [
        migrations.AddField(
            model_name="transition",
            name="process_of",
            field=models.JSONField(
                blank=True, null=True,
                help_text="the device map: the union-world process of each destination rank (process p < "
                          "source_world is source rank p, the others are joining); null: destination rank d on "
                          "process d"),
        ),
        migrations.AlterField(
            model_name="transition",
            name="destination_placement",
            field=models.JSONField(
                blank=True, default=list,
                help_text="where the destination layout's ranks run: on the GPUs of the processes the device map "
                          "gives them (a staying process keeps its GPU, joining ones get new GPUs)"),
        ),
    ]
