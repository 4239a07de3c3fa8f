from django.contrib import admin

from controlplane.emulation.models import EmulationRun


@admin.register(EmulationRun)
class EmulationRunAdmin(admin.ModelAdmin):
    list_display = ["id", "model", "layout", "gpus", "gpu_type", "state", "created_at", "wall_seconds"]
    list_filter = ["state", "gpu_type", "model"]
    search_fields = ["model", "layout"]
