"""A newcomer's first commands: a database that was never migrated, ``load_snapshot``'s
``--no-pass`` and what it says it did in the embedded mode, and ``issue_token`` asked for
namespaces that do not exist or for none."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError

from binder import models
from harness.shapes import H100, class_obj, gpu_obj, namespace_obj, node_obj, write_snapshot

ROOT = Path(django_settings.BASE_DIR)


def snapshot(tmp_path: Path, name: str = "cluster.yaml") -> Path:
    return write_snapshot(
        tmp_path / name,
        [namespace_obj("t1"), class_obj("h100", H100), node_obj("n1", {H100: 4}), gpu_obj("t1", "g0", "h100", "vm1")],
    )


@pytest.mark.parametrize("command", [["load_snapshot", "cluster.yaml"], ["run_pass"], ["dump_state", "--json"]])
def test_a_command_on_a_database_never_migrated_says_run_migrate(tmp_path: Path, command: list[str]) -> None:
    snapshot(tmp_path)
    done = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), *command],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "DATABASE_URL": f"sqlite:///{tmp_path / 'fresh.sqlite3'}"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "not migrated" in done.stderr
    assert "manage.py migrate" in done.stderr


@pytest.mark.django_db
def test_load_snapshot_replace_no_pass_runs_no_pass(
    tmp_path: Path, settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    """--replace deletes the mirror's rows first; their deletions must not ask for a pass
    (in the embedded mode one would run at once) when --no-pass says none."""
    settings.GPUPLANE_AUTO_PASS = True
    assert settings.CELERY_TASK_ALWAYS_EAGER  # embedded: a queued pass would run in-process
    call_command("load_snapshot", str(snapshot(tmp_path)), "--no-pass", stdout=io.StringIO())
    assert models.GpuDevice.objects.exists() and not models.PassRun.objects.exists()
    out = io.StringIO()
    with django_capture_on_commit_callbacks(execute=True) as callbacks:  # commits run them
        call_command("load_snapshot", str(snapshot(tmp_path)), "--replace", "--no-pass", stdout=out)
    assert callbacks == []
    assert not models.PassRun.objects.exists()
    assert "pass" not in out.getvalue()
    assert models.GpuDevice.objects.get(name="g0").phase == "Pending"


@pytest.mark.django_db
def test_load_snapshot_in_the_embedded_mode_says_the_pass_it_ran_and_warns_of_nothing(
    tmp_path: Path, settings: Any, caplog: pytest.LogCaptureFixture, django_capture_on_commit_callbacks: Any
) -> None:
    settings.GPUPLANE_AUTO_PASS = True
    settings.GPUPLANE_CHECKPOINTS = True
    out = io.StringIO()
    call_command("load_snapshot", str(snapshot(tmp_path)), "--no-pass", stdout=io.StringIO())
    with caplog.at_level(logging.WARNING), django_capture_on_commit_callbacks(execute=True):
        call_command("load_snapshot", str(snapshot(tmp_path)), "--replace", stdout=out)
    run = models.PassRun.objects.get()  # exactly one pass, the command's
    assert run.kind == models.PassKind.FULL and run.bound == 1
    assert "queued" not in out.getvalue()
    assert f"ran full pass {run.pk}: bound 1" in out.getvalue()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.django_db
def test_issue_token_warns_of_a_namespace_that_does_not_exist() -> None:
    models.Namespace.objects.create(name="acme", uid="uid-acme")
    out, err = io.StringIO(), io.StringIO()
    call_command("issue_token", "carol", "--namespaces", "nope,acme", stdout=out, stderr=err)
    assert "no such namespace (yet): nope;" in err.getvalue()
    assert "acme" not in err.getvalue()
    assert "this token may read: acme, nope" in out.getvalue()


@pytest.mark.django_db
def test_issue_token_with_no_namespaces_is_refused_for_a_tenant() -> None:
    with pytest.raises(CommandError, match="no namespaces given: a token for dave would read nothing"):
        call_command("issue_token", "dave", stdout=io.StringIO())
    assert not get_user_model().objects.filter(username="dave").exists()  # nothing written


@pytest.mark.django_db
def test_issue_token_with_no_namespaces_is_fine_for_staff() -> None:
    get_user_model().objects.create(username="erin", is_staff=True)
    out = io.StringIO()
    call_command("issue_token", "erin", stdout=out)
    assert "staff: reads every namespace" in out.getvalue()
