from django.contrib import admin

from controlplane.cluster.models import Gpu, Node


class GpuInline(admin.TabularInline):
    model = Gpu
    extra = 0
    fields = ["index", "model_name", "memory_bytes", "state", "job"]
    readonly_fields = fields


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ["name", "host", "device", "state", "gpu_count", "last_heartbeat"]
    list_filter = ["state", "device"]
    search_fields = ["name", "host"]
    inlines = [GpuInline]


@admin.register(Gpu)
class GpuAdmin(admin.ModelAdmin):
    list_display = ["__str__", "model_name", "memory_bytes", "state", "job"]
    list_filter = ["state", "node", "model_name"]
