"""The Datasets page: what is registered (tokens, documents, vocab, tokenizer, validation split,
the jobs that train on each) and a form that registers a directory under the data root
(POST /api/datasets, datasets.js; the API's refusals beside the field they name)."""
from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest
from django.shortcuts import render

from controlplane.datasets.selectors import dataset_list


@login_required
def datasets_page(request: HttpRequest):
    datasets = list(dataset_list().prefetch_related("jobs"))
    for dataset in datasets:
        dataset.job_rows = sorted(dataset.jobs.all(), key=lambda job: job.name)
    return render(request, "frontend/datasets.html", {"datasets": datasets})
