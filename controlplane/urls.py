from django.contrib import admin
from django.http import JsonResponse
from django.views.defaults import page_not_found
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.routers import DefaultRouter

from controlplane.cluster.agent_api import AgentJoinView, AgentTokenRevokeView, AgentTokensView
from controlplane.cluster.api import ClusterSnapshotView, GpuViewSet, NodeViewSet
from controlplane.common.api import HealthView, ModelViewSet
from controlplane.common.api_docs import OfflineRedocView, redoc_bundle
from controlplane.datasets.api import DatasetViewSet
from controlplane.emulation.api import EmulationRunViewSet
from controlplane.exports.api import ExportViewSet, JobExportsView, JobExportView
from controlplane.jobs.api import JobViewSet, TransitionViewSet
from controlplane.jobs.elastic_api import ElasticPlanView

router = DefaultRouter(trailing_slash=False)
router.register("nodes", NodeViewSet, basename="node")
router.register("gpus", GpuViewSet, basename="gpu")
router.register("jobs", JobViewSet, basename="job")
router.register("transitions", TransitionViewSet, basename="transition")
router.register("emulations", EmulationRunViewSet, basename="emulation")
router.register("models", ModelViewSet, basename="model")
router.register("datasets", DatasetViewSet, basename="dataset")
router.register("exports", ExportViewSet, basename="export")

def not_found(request, exception=None):
    """A path under /api/ that names no route (e.g. /api/jobs/0.5) answers as the API does:
    JSON {"detail": ...}; other paths get Django's page."""
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": f"no API route at {request.path[:200]}"}, status=404)
    return page_not_found(request, exception)


handler404 = not_found
handler500 = "frontend.error_views.server_error"  # the 500 page with the site's navigation

urlpatterns = [
    path("api/health", HealthView.as_view(), name="health"),
    path("api/cluster/snapshot", ClusterSnapshotView.as_view(), name="cluster-snapshot"),
    path("api/elastic", ElasticPlanView.as_view(), name="elastic-plan"),
    path("api/agent-tokens", AgentTokensView.as_view(), name="agent-tokens"),
    path("api/agent-tokens/<str:key_id>/revoke", AgentTokenRevokeView.as_view(), name="agent-token-revoke"),
    path("api/agents/join", AgentJoinView.as_view(), name="agent-join"),
    path("api/jobs/<int:job_id>/export", JobExportView.as_view(), name="job-export"),
    path("api/jobs/<int:job_id>/exports", JobExportsView.as_view(), name="job-exports"),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    # Interactive docs of the schema above, with drf-spectacular-sidecar's local copies of
    # Swagger UI and ReDoc (no CDN: they work on a machine without internet).
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("api/redoc/", OfflineRedocView.as_view(url_name="schema"), name="api-redoc"),
    path("api/redoc/redoc.standalone.js", redoc_bundle, name="api-redoc-bundle"),
    path("api/", include(router.urls)),
    path("admin/", admin.site.urls),
    path("", include("frontend.urls")),
]
