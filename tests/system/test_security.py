"""Security properties: isolation on every endpoint, a staff-only admin with
CSRF, secrets only from the environment, nothing secret in the repository.

These tests enumerate what exists (the OpenAPI paths, the admin's URLs, the tracked
files) instead of listing it by hand, so an endpoint or page added later is covered or
makes a test fail until it is.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver

from harness.accounts import account, token_client
from harness.factories import TENANT_B_URLS

ROOT = Path(__file__).resolve().parents[2]


def schema_paths() -> set[str]:
    from drf_spectacular.generators import SchemaGenerator

    return set(SchemaGenerator().get_schema(request=None, public=True)["paths"])


def test_every_tenant_endpoint_is_in_the_isolation_test() -> None:
    """Each API path (the webhook aside: the kube-apiserver's, not a tenant's) has a
    tenant-B URL in ``harness.factories.TENANT_B_URLS``, for which tests/usage/test_usage_api.py
    asserts 404 for tenant A, 401 without a token, and the same body as for a namespace
    that does not exist."""
    covered = set()
    for template in schema_paths() - {"/webhooks/vmi"}:
        pattern = re.compile("^" + re.sub(r"\{[^}]+\}", "[^/?]+", template) + r"(\?.*)?$")
        if any(pattern.match(url) for url in TENANT_B_URLS):
            covered.add(template)
    assert covered == schema_paths() - {"/webhooks/vmi"}


def admin_urls() -> list[str]:
    """Every admin URL without parameters (pages and changelists)."""
    urls = []

    def walk(patterns: list[Any], prefix: str) -> None:
        for p in patterns:
            route = str(p.pattern)
            if isinstance(p, URLResolver):
                walk(p.url_patterns, prefix + route)
            elif isinstance(p, URLPattern) and "<" not in route and "(?P" not in route:
                urls.append("/" + (prefix + route).lstrip("^").replace("$", "").replace("\\Z", ""))

    admin = next(p for p in get_resolver().url_patterns if str(p.pattern) == "admin/")
    walk(admin.url_patterns, "admin/")
    return sorted(u for u in set(urls) if "logout" not in u and "login" not in u and "jsi18n" not in u)


@pytest.mark.django_db
def test_the_admin_is_staff_only_for_every_page(cluster: Any) -> None:
    urls = admin_urls()
    assert "/admin/placement-board/" in urls and len(urls) > 10
    tenant = account("alice", "t1")
    tenant_client = Client()
    tenant_client.force_login(tenant)
    token = token_client(tenant)
    for url in urls:
        for who in (Client(), tenant_client, token):
            answer = who.get(url)
            assert answer.status_code == 302 and "/admin/login/" in answer["Location"], (url, answer.status_code)
    staff = Client()
    root = account("root", staff=True)
    staff.force_login(root)
    assert staff.get("/admin/placement-board/").status_code == 403  # staff, but without the view permissions
    root.is_superuser = True
    root.save()
    assert staff.get("/admin/placement-board/").status_code == 200


@pytest.mark.django_db
def test_admin_actions_need_a_csrf_token(cluster: Any) -> None:
    staff = Client(enforce_csrf_checks=True)
    staff.force_login(account("root", staff=True))
    for url in ("/admin/run-pass/", "/admin/binder/lostset/"):
        answer = staff.post(url, {"action": "retry", "_selected_action": ["1"]})
        assert answer.status_code == 403, (url, answer.status_code)
        assert b"CSRF" in answer.content


def test_the_secret_key_comes_from_the_environment() -> None:
    code = "import django, os; os.environ['DJANGO_SETTINGS_MODULE']='gpuplane.settings'; django.setup(); " \
           "from django.conf import settings; print(settings.SECRET_KEY)"  # fmt: skip
    env = {**os.environ, "DJANGO_SECRET_KEY": "from-the-environment-" + "x" * 40}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == env["DJANGO_SECRET_KEY"]


def test_the_secret_key_is_stripped_of_surrounding_whitespace(monkeypatch: pytest.MonkeyPatch) -> None:
    """A key pasted with a newline (``--from-file``, an editor) signs what the other pods
    check; a key of whitespace alone stops start-up instead of falling back to a random one.
    (Settings read it once at start-up, through this function; the test above starts a
    process to see the whole path.)"""
    from django.core.exceptions import ImproperlyConfigured

    from gpuplane.settings import _secret_key

    key = "from-the-environment-" + "y" * 40
    monkeypatch.setenv("DJANGO_SECRET_KEY", f"  {key}\n")
    assert _secret_key() == key
    monkeypatch.setenv("DJANGO_SECRET_KEY", " \n")
    with pytest.raises(ImproperlyConfigured, match="DJANGO_SECRET_KEY is only whitespace"):
        _secret_key()


SECRET_PATTERNS = {
    "private key": re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----\s*\n[A-Za-z0-9+/=]{40,}"),
    "API token": re.compile(r"\bgpp_[0-9a-f]{64}\b"),
    "password in a URL": re.compile(r"(postgres(ql)?|redis|amqp)://[^:/\s]+:(?!\.\.\.@|<)[^@/\s]{3,}@"),
    "AWS key": re.compile(r"AKIA[0-9A-Z]{16}"),
}


def test_no_secret_is_tracked_in_the_repository() -> None:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    found = []
    for name in filter(None, files):
        path = ROOT / name.decode()
        if not path.is_file() or path.stat().st_size > 2_000_000:
            continue
        text = path.read_bytes().decode("utf-8", "replace")
        for what, pattern in SECRET_PATTERNS.items():
            if pattern.search(text):
                found.append(f"{name.decode()}: {what}")
    assert not found, found
    ignored = (ROOT / ".gitignore").read_text()
    assert "/var/" in ignored  # the embedded secret key, SQLite file and dev certificates live there
