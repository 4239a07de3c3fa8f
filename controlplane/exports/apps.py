from django.apps import AppConfig


class ExportsConfig(AppConfig):
    name = "controlplane.exports"
    label = "exports"
    verbose_name = "Exports"
