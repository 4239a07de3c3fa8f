from django.contrib import admin

from controlplane.common.models import EventStream


@admin.register(EventStream)
class EventStreamAdmin(admin.ModelAdmin):
    list_display = ["name", "seq"]
