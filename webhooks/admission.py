"""The VMI admission decision's public face: parse, decide, patch, answer (Django-free).

One import for the HTTP side and the tests. Each concern lives in its own module:

- ``webhooks.review``: the strict AdmissionReview parser (:func:`parse_review`,
  :class:`ReviewError` naming the bad field, :func:`error_body` for the 400);
- ``binder.engine.matching``: node affinity matching (:func:`term_matches`), pure so
  the engine can share it;
- ``webhooks.decision``: :func:`decide` from the review and a read-only
  :class:`MirrorView`, :func:`conclude` from the binder's answers, every denial, and
  the AdmissionReview :func:`response`;
- ``webhooks.patch``: the JSONPatch (:func:`build_patch`, :func:`encode_patch`).

None of them imports Django or does I/O.
"""

from __future__ import annotations

from binder.engine.matching import NAME_FIELD, Requirement, Term, term_matches
from webhooks.decision import (
    DENIED_CODE,
    Action,
    DeviceIndex,
    MirrorView,
    Verdict,
    advisory_budget_refusal,
    answer_pass_failed,
    bind_request_refused,
    conclude,
    database_unavailable,
    decide,
    device_gone,
    no_time_to_bind,
    overloaded,
    response,
    scheduling_conflict,
    set_changed,
    set_kept_moving,
    timed_out,
    too_many_waiting,
)
from webhooks.patch import HOSTNAME_LABEL, build_patch, encode_patch, missing_tolerations
from webhooks.review import (
    DEVICE_PREFIX,
    REVIEW_API_VERSION,
    REVIEW_KIND,
    Named,
    Review,
    ReviewError,
    Scheduling,
    error_body,
    parse_review,
    parse_scheduling,
)

__all__ = [
    "DENIED_CODE",
    "DEVICE_PREFIX",
    "HOSTNAME_LABEL",
    "NAME_FIELD",
    "REVIEW_API_VERSION",
    "REVIEW_KIND",
    "Action",
    "DeviceIndex",
    "MirrorView",
    "Named",
    "Requirement",
    "Review",
    "ReviewError",
    "Scheduling",
    "Term",
    "Verdict",
    "advisory_budget_refusal",
    "answer_pass_failed",
    "bind_request_refused",
    "build_patch",
    "conclude",
    "database_unavailable",
    "decide",
    "device_gone",
    "encode_patch",
    "error_body",
    "missing_tolerations",
    "overloaded",
    "parse_review",
    "parse_scheduling",
    "response",
    "scheduling_conflict",
    "set_changed",
    "set_kept_moving",
    "term_matches",
    "no_time_to_bind",
    "timed_out",
    "too_many_waiting",
]
