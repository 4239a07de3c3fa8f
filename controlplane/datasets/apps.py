from django.apps import AppConfig


class DatasetsConfig(AppConfig):
    name = "controlplane.datasets"
    label = "datasets"
    verbose_name = "Datasets"
