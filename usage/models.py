"""Who may read which tenant's usage, and the usage records as the usage app sees them.

The records themselves are the binder's: its full passes write them
(``binder.runtime.usage_records``) and its model (``binder.models.UsageRecord``) keeps
them append-only. This app reads them: the tenant API, the daily roll-ups, the queries
and the admin, through :class:`UsageRecord`, a proxy that gives them their admin page
(``/admin/usage/usagerecord/``) and their permission (``usage.view_usagerecord``).
"""

from __future__ import annotations

from typing import ClassVar

from django.conf import settings
from django.db import models

from binder import models as binder_models


class UsageRecord(binder_models.UsageRecord):
    """A usage record, read by the usage app (the binder writes them)."""

    objects: ClassVar[models.Manager[UsageRecord]] = binder_models.UsageRecordQuerySet["UsageRecord"].as_manager()

    class Meta:
        proxy = True
        ordering = ["start", "id"]


class NamespaceGrant(models.Model):
    """Lets one API token read one tenant namespace (a token names its namespaces).

    Grants belong to the token, not the user: a second ``issue_token u --namespaces b``
    used to widen u's older token for ``a`` to ``b`` as well. ``user`` is the token's
    user, kept for the admin and for ``revoke_token --user``.

    The namespace is a name, not a link: a grant may be made before the namespace is
    mirrored, and it keeps giving access to that tenant's usage history after the
    namespace is deleted. ``namespace_uid`` is the namespace's UID when the grant was made
    (if it was mirrored): a namespace deleted and created again under the same name has a
    new UID, is another tenant, and the old grant does not read it. Staff with the admin's
    view permissions read every namespace without grants.
    """

    token = models.ForeignKey("knox.AuthToken", on_delete=models.CASCADE, related_name="namespace_grants")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="namespace_grants")
    namespace = models.CharField(max_length=63)
    namespace_uid = models.CharField(
        max_length=64, blank=True, help_text="the namespace's UID when granted (empty: not mirrored then)"
    )
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["user__username", "namespace", "created"]
        constraints = [models.UniqueConstraint(fields=["token", "namespace"], name="uniq_grant_per_token_namespace")]

    def __str__(self) -> str:
        return f"token {self.token.token_key}… of {self.user} may read {self.namespace}"
