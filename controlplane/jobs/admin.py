from django.contrib import admin

from controlplane.jobs.models import Job, MetricChunk, MetricSeries, Transition


class TransitionInline(admin.TabularInline):
    model = Transition
    extra = 0
    fields = ["source_layout", "destination_layout", "state", "created_at", "pause_seconds", "network_bytes"]
    readonly_fields = fields


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ["name", "model", "layout", "world_size", "state", "created_at"]
    list_filter = ["state", "model"]
    search_fields = ["name", "model", "layout"]
    inlines = [TransitionInline]


@admin.register(Transition)
class TransitionAdmin(admin.ModelAdmin):
    list_display = ["id", "job", "source_layout", "destination_layout", "state", "created_at", "pause_seconds"]
    list_filter = ["state"]
    search_fields = ["job__name", "source_layout", "destination_layout"]


@admin.register(MetricSeries)
class MetricSeriesAdmin(admin.ModelAdmin):
    list_display = ["__str__", "job", "transition", "name", "rank", "unit", "points"]
    list_filter = ["name"]


@admin.register(MetricChunk)
class MetricChunkAdmin(admin.ModelAdmin):
    list_display = ["series", "first_point", "count"]
