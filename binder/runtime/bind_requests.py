"""The bind request: both ends of the protocol between the webhook and the binder's passes.

A VMI's webhook call asks for its set to be placed by writing a bind request on the set's
device rows, and waits for a pass to answer it there. Who writes which column:

- **the webhook** (``webhooks.binding``, through :func:`write_requests`,
  :func:`write_or_join` and :func:`inflight_request`): :data:`REQUEST_COLUMNS`, a new
  request id on every device of the set, when it was written and the VMI's nodeSelector.
  In cluster mode the request is the GPU object's ``gpuplane.io/bind-request`` annotation
  (``binder.kube.client``), mirrored into the same columns;
- **the change feed** carries those rows to the binder like any device change: a device
  whose ``bind_request`` is not its ``answered_request`` waits for an answer
  (``binder.engine.types.Device.wants_answer``), and an answer pass places those sets;
- **the pass** (``binder.runtime.passes``): :data:`ANSWER_COLUMNS`, the request it
  answered and the answer, with the device's other fields, never a request column; and
  one ``BindAnswer`` row per answered request (:func:`record_answers`), then it wakes the
  waiting calls (``binder.runtime.answers``);
- **the webhook** reads the answers back (:func:`read_rows`) until every device of the
  set answered its request.

Everything here takes plain arguments (namespace, VM, device names, node selector): what
to answer the caller is the webhook's decision.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from django.db import connection
from django.db.models import Q
from django.utils import timezone

from binder import models
from binder.engine import ANSWER_BOUND, Device, PassResult
from binder.engine import types as e
from binder.mirror.read import KINDS

#: The device columns the webhook writes (a pass never does).
REQUEST_COLUMNS = ("bind_request", "bind_requested_at", "bind_node_selector")
#: The device columns a pass writes to answer (the webhook only reads them).
ANSWER_COLUMNS = ("answered_request", "answer")


def _device_table() -> tuple[str, str]:
    return models.GpuDevice._meta.db_table, models.Namespace._meta.db_table


def inflight_request(namespace: str, vm: str, names: tuple[str, ...], wait: float) -> str | None:
    """The set's bind request still waiting for its answer, if one was written within the
    last ``wait`` seconds (an older unanswered one belongs to a call that gave up: replace it)."""
    devices, namespaces = _device_table()
    marks = ", ".join(["%s"] * len(names))
    with connection.cursor() as cursor:
        # One fixed statement (the ORM compiled a join for it on every call).
        cursor.execute(
            f"SELECT d.bind_request, d.answered_request, d.bind_requested_at FROM {devices} d"  # noqa: S608
            f" JOIN {namespaces} n ON n.id = d.namespace_id"
            f" WHERE n.name = %s AND d.vm_name = %s AND d.name IN ({marks})",
            [namespace, vm, *names],
        )
        rows = [(request, answered, _aware(at)) for request, answered, at in cursor.fetchall()]
    if len(rows) != len(names):
        return None
    requests = {request for request, _, _ in rows}
    (request,) = requests if len(requests) == 1 else ("",)
    fresh_after = timezone.now() - timedelta(seconds=wait)
    if not request or any(answered == request or at is None or at < fresh_after for _, answered, at in rows):
        return None
    return request


def _aware(value: Any) -> datetime | None:
    """A timestamp column read with a raw cursor, as the ORM would give it (aware, UTC)."""
    if value is None:
        return None
    if isinstance(value, str):  # SQLite returns text
        value = datetime.fromisoformat(value)
    return value if timezone.is_aware(value) else timezone.make_aware(value, UTC)


def write_requests(
    namespace: str,
    vm: str,
    names: tuple[str, ...],
    request_id: str,
    node_selector: Mapping[str, str],
    wait: float | None = None,
) -> int:
    """Write ``request_id`` (and the VMI's ``node_selector``) on the set's devices; the rows written.

    All or none: one statement, written only when every named device is still the VM's
    (else 0 rows, and the call is told its set changed). One statement needs no
    transaction of its own: a BEGIN and a COMMIT were two more round trips per call,
    each waiting for a core under load. With ``wait``, also nothing when the set has a
    request in flight by :func:`inflight_request`'s rule (its statement, folded in: the
    caller then joins that request), so the common case, no request in flight, is one
    round trip."""
    devices, namespaces = _device_table()
    field = models.GpuDevice._meta.get_field("bind_node_selector")
    selector = field.get_db_prep_value(dict(node_selector), connection)
    now = timezone.now()
    marks = ", ".join(["%s"] * len(names))
    where = (
        f"namespace_id = (SELECT id FROM {namespaces} WHERE name = %s)"  # noqa: S608
        f" AND vm_name = %s AND name IN ({marks})"
    )
    owner = [namespace, vm, *names]
    check = "count(*) = %s"
    params: list[Any] = [len(names)]
    if wait is not None:
        # Not in flight: a device without a request, or answered, or written before the
        # wait began, or the set's devices carry different requests.
        check += (
            " AND (count(DISTINCT bind_request) <> 1 OR min(bind_request) = ''"
            " OR sum(CASE WHEN answered_request = bind_request OR bind_requested_at IS NULL"
            " OR bind_requested_at < %s THEN 1 ELSE 0 END) > 0)"
        )
        params.append(connection.ops.adapt_datetimefield_value(now - timedelta(seconds=wait)))
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {devices} SET bind_request = %s, bind_requested_at = %s, bind_node_selector = %s"  # noqa: S608
            f" WHERE {where} AND (SELECT CASE WHEN {check} THEN 1 ELSE 0 END FROM {devices} WHERE {where}) = 1",
            [request_id, connection.ops.adapt_datetimefield_value(now), selector, *owner, *params, *owner],
        )
        return int(cursor.rowcount)


#: Tries at writing a new request or joining the one in flight before a set is taken as changed.
WRITE_TRIES = 3


def write_or_join(
    namespace: str, vm: str, names: tuple[str, ...], request_id: str, node_selector: Mapping[str, str], wait: float
) -> str | None:
    """Standalone mode: ``request_id`` written on every device of the set, or the request
    in flight there to join (returned; ``request_id`` when ours was written); None when
    the set changed under the check. A request in flight answered between the two
    statements makes the write go through on the next try."""
    for _ in range(WRITE_TRIES):
        if write_requests(namespace, vm, names, request_id, node_selector, wait) == len(names):
            return request_id
        joined = inflight_request(namespace, vm, names, wait)
        if joined is not None:
            return joined
    return None


def read_rows(wanted: Iterable[tuple[str, tuple[str, ...]]]) -> dict[tuple[str, str], Device]:
    """The rows of the devices of ``wanted`` ((namespace, names) pairs), one statement,
    whole: a call whose answers are all in builds its patch from them with no other read."""
    by_namespace: dict[str, set[str]] = {}
    for namespace, names in wanted:
        by_namespace.setdefault(namespace, set()).update(names)
    if not by_namespace:
        return {}
    model, convert, fields = KINDS["GPU"]
    which = Q()
    for namespace in sorted(by_namespace):
        which |= Q(namespace__name=namespace, name__in=sorted(by_namespace[namespace]))
    found: dict[tuple[str, str], Device] = {}
    for namespace, name, *values in (
        model.objects.filter(which).order_by().values_list("namespace__name", "name", *fields)
    ):
        found[(namespace, name)] = convert(namespace, name, *values)
    return found


def record_answers(run: models.PassRun, result: PassResult, ids: dict[tuple[str, str], int]) -> None:
    """One BindAnswer per request this pass answered, with its latency when known."""
    keys = set(result.answered)
    answered = [d for d in result.devices if d.key in keys and d.key in ids]
    if not answered:
        return
    if connection.vendor == "postgresql":
        _record_answers_postgresql(run, answered, ids)
        return
    requested = dict(
        models.GpuDevice.objects.filter(id__in=[ids[d.key] for d in answered]).values_list("id", "bind_requested_at")
    )
    now = timezone.now()
    rows = []
    for device in answered:
        at = requested.get(ids[device.key])
        rows.append(
            models.BindAnswer(
                pass_run=run,
                namespace=device.namespace,
                device_name=device.name,
                request=device.answered_request,
                allowed=device.answer.startswith(ANSWER_BOUND),
                answer=device.answer,
                requested_at=at,
                answered_at=now,
                latency_ms=(now - at).total_seconds() * 1000 if at else None,
            )
        )
    models.BindAnswer.objects.bulk_create(rows, batch_size=1000)


def _record_answers_postgresql(run: models.PassRun, answered: list[e.Device], ids: dict[tuple[str, str], int]) -> None:
    """:func:`record_answers` in one statement: the request times are joined from the
    device rows by the INSERT itself (an answer pass is a dozen round trips; this was two)."""
    now = timezone.now()
    with connection.cursor() as cursor:
        binary = psycopg.Cursor(cursor.cursor.connection)
        binary.execute(
            "INSERT INTO binder_bindanswer (pass_run_id, namespace, device_name, request, allowed, answer,"
            " requested_at, answered_at, latency_ms)"
            " SELECT %b, v.ns, v.name, v.request, v.allowed, v.answer, d.bind_requested_at, %b,"
            " extract(epoch FROM %b - d.bind_requested_at)::float8 * 1000"
            " FROM unnest(%b::bigint[], %b::text[], %b::text[], %b::text[], %b::boolean[], %b::text[]) WITH ORDINALITY"
            " AS v(id, ns, name, request, allowed, answer, n)"
            " LEFT JOIN binder_gpudevice AS d ON d.id = v.id ORDER BY v.n",
            [
                run.pk,
                now,
                now,
                [ids[d.key] for d in answered],
                [d.namespace for d in answered],
                [d.name for d in answered],
                [d.answered_request for d in answered],
                [d.answer.startswith(ANSWER_BOUND) for d in answered],
                [d.answer for d in answered],
            ],
        )
