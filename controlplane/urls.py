from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView
from rest_framework.routers import DefaultRouter

from controlplane.cluster.api import ClusterSnapshotView, GpuViewSet, NodeViewSet
from controlplane.common.api import HealthView
from controlplane.emulation.api import EmulationRunViewSet
from controlplane.jobs.api import JobViewSet, TransitionViewSet

router = DefaultRouter(trailing_slash=False)
router.register("nodes", NodeViewSet, basename="node")
router.register("gpus", GpuViewSet, basename="gpu")
router.register("jobs", JobViewSet, basename="job")
router.register("transitions", TransitionViewSet, basename="transition")
router.register("emulations", EmulationRunViewSet, basename="emulation")

urlpatterns = [
    path("api/health", HealthView.as_view(), name="health"),
    path("api/cluster/snapshot", ClusterSnapshotView.as_view(), name="cluster-snapshot"),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/", include(router.urls)),
    path("admin/", admin.site.urls),
    path("", include("frontend.urls")),
]
