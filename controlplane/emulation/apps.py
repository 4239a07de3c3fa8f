from django.apps import AppConfig


class EmulationConfig(AppConfig):
    name = "controlplane.emulation"
    label = "emulation"
    verbose_name = "Emulation runs"
