"""The decision log shows one row per pass and set for devices moved alike: the demo's
Lost set of 8 is one row naming its 8 devices, not 8 identical rows; rows that differ
(another pass, another from, to or reason) stay apart."""

from __future__ import annotations

import re

import pytest
from django.test import Client
from django.urls import reverse

from binder import models
from binder.reports.history import decision_log

pytestmark = pytest.mark.django_db


def test_one_pass_moving_a_set_alike_is_one_row(admin_client: Client, demo: None) -> None:
    url = reverse("admin:decisions") + "?namespace=team-nlp&vm=llm-train-a"
    html = admin_client.get(url).content.decode()
    rows = re.findall(r'<tr class="decision"[^>]*data-devices="(\d+)"', html)
    assert rows == ["8"]
    assert "8 devices: llm-train-a-gpu" in html
    assert all(f"llm-train-a-gpu{i}" in html for i in range(8))


def test_changes_that_differ_stay_apart(demo: None) -> None:
    log = decision_log("team-nlp", vm="llm-train-a")
    first = log.decisions[0]
    # The same pass, one device's change told with another reason: two rows.
    models.Decision.objects.filter(pk=first.pk).update(reason="another reason")
    groups = decision_log("team-nlp", vm="llm-train-a").groups
    assert sorted(len(g.devices) for g in groups) == [1, 7]
    assert sum(len(g.devices) for g in groups) == len(log.decisions)
