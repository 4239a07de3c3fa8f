from django.contrib.auth import views as auth_views
from django.urls import path

from frontend import agent_views, compare_views, dataset_views, elastic_views, job_views, views

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("cluster/snapshot.json", views.dashboard_snapshot, name="dashboard-snapshot"),
    path("compare/", compare_views.compare, name="compare"),
    path("compare/data", compare_views.compare_data, name="compare-data"),
    path("compare/export.csv", compare_views.compare_export, name="compare-export"),
    path("agents/", agent_views.agents_page, name="agents"),
    path("datasets/", dataset_views.datasets_page, name="datasets"),
    path("elastic/", elastic_views.elastic_page, name="elastic"),
    path("elastic/timeline.json", elastic_views.elastic_timeline, name="elastic-timeline"),
    path("jobs/", job_views.jobs_list, name="jobs"),
    path("jobs/<int:job_id>/", job_views.job_detail, name="job"),
    path("jobs/<int:job_id>/state.json", job_views.job_state, name="job-state"),
    path("jobs/<int:job_id>/plan-figures.json", job_views.job_plan_figures, name="job-plan-figures"),
    path("transitions/<int:transition_id>/", job_views.transition_detail, name="transition"),
    path("transitions/<int:transition_id>/wave.json", job_views.transition_wave, name="transition-wave"),
    path("accounts/login/", auth_views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
]
