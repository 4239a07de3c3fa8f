from django.contrib import admin

from controlplane.exports.models import Export


@admin.register(Export)
class ExportAdmin(admin.ModelAdmin):
    list_display = ["id", "job_name", "checkpoint_step", "state", "path", "files_written", "files_total", "bytes",
                    "created_at"]
    list_filter = ["state"]
    search_fields = ["job_name", "path"]
