from django.contrib import admin

from controlplane.datasets.models import Dataset


@admin.register(Dataset)
class DatasetAdmin(admin.ModelAdmin):
    list_display = ["id", "name", "path", "format", "vocab_size", "tokenizer", "documents", "tokens", "created_at"]
    list_filter = ["format", "tokenizer"]
    search_fields = ["name", "path"]
