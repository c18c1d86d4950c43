"""``django.contrib.admin`` with gpuplane's site as the default one.

Apart from the site itself: Django imports this module while it populates the app
registry, before any model can be imported, and the site's pages import models. Django
imports ``default_site`` only when the admin is ready.
"""

from django.contrib.admin.apps import AdminConfig


class GpuplaneAdminConfig(AdminConfig):
    """``django.contrib.admin`` with :class:`gpuplane.staff.site.GpuplaneAdminSite` as the default site."""

    default_site = "gpuplane.staff.site.GpuplaneAdminSite"
