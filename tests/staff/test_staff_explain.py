"""Lost and Pending sets explained on the staff pages, on the demo
cluster: the board's Lost and Pending lists, the Lost sets view and the device page say
what a set needs, the largest gap, who holds the rest, what would fit, and flag the
VMI's NotReady node."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from binder import models
from binder.mirror.snapshot import load_file
from binder.runtime.passes import run_pass
from gpuplane.management.commands.demo import DEMO_FILE

pytestmark = pytest.mark.django_db


@pytest.fixture
def demo() -> None:
    load_file(DEMO_FILE, replace=True)
    run_pass()
    run_pass()


def _block(html: str, marker: str) -> str:
    start = html.index(marker)
    return html[start : html.index("</tr>", start)]


def test_board_explains_the_lost_and_pending_sets(admin_client: Client, demo: None) -> None:
    html = admin_client.get(reverse("admin:placement-board")).content.decode()
    lost = _block(html, 'id="lost-team-nlp-llm-train-a"')
    assert "needs 8 × h100 on one node; the largest gap is 0 on hgx-h100-01" in lost
    assert 'class="vmi notready"' in lost and "running on hgx-h100-05, which is NotReady since" in lost
    assert "on hgx-h100-05: bring it back to Ready" in lost
    assert "on hgx-h100-04: uncordon it and free 2 (held by set team-nlp/rag-serve (2))" in lost
    assert "last pass: lost: node hgx-h100-05 has been NotReady" in lost
    md_sim = _block(html, 'class="pending-set" data-set="team-research/md-sim"')
    assert "over budget: class key h100 has limit 6" in md_sim
    assert "class l40s does not exist" in _block(html, 'data-set="team-research/l40s-probe"')
    assert "no node has 1 nvidia.com/NVIDIA_A10-12Q allocatable" in _block(html, 'data-set="team-sandbox/vdi-01"')


def test_lost_sets_view_explains_and_flags_the_notready_node(admin_client: Client, demo: None) -> None:
    html = admin_client.get(reverse("admin:binder_lostset_changelist")).content.decode()
    row = _block(html, 'class="lost-set" data-set="team-nlp/llm-train-a"')
    assert "running on hgx-h100-05" in row
    assert '<span class="badge notready"' in row
    assert "the largest gap is 0 on hgx-h100-01" in row
    assert 'id="pending-sets"' in html and 'data-set="team-research/md-sim"' in html


def test_explanation_follows_the_cluster_not_the_last_pass(admin_client: Client, demo: None) -> None:
    """Uncordon hgx-h100-04 without a pass: the stored reason is stale, the explanation is not."""
    models.Node.objects.filter(name="hgx-h100-04").update(unschedulable=False)
    html = admin_client.get(reverse("admin:binder_lostset_changelist")).content.decode()
    row = _block(html, 'class="lost-set" data-set="team-nlp/llm-train-a"')
    assert "the largest gap is 6 on hgx-h100-04, 2 held by set team-nlp/rag-serve (2)" in row
    assert "on hgx-h100-04: free 2 (held by set team-nlp/rag-serve (2))" in row


def test_device_page_explains_a_lost_device_and_not_a_bound_one(admin_client: Client, demo: None) -> None:
    lost = models.GpuDevice.objects.get(name="llm-train-a-gpu0")
    html = admin_client.get(reverse("admin:binder_gpudevice_change", args=[lost.pk])).content.decode()
    assert "why not placed, now" in html.lower()
    assert "needs 8 × h100 on one node" in html and "NotReady since" in html
    bound = models.GpuDevice.objects.filter(phase="Bound").first()
    assert bound is not None
    html = admin_client.get(reverse("admin:binder_gpudevice_change", args=[bound.pk])).content.decode()
    assert "needs 8 × h100" not in html and 'class="explain"' not in html


def test_explanations_escape_names(admin_client: Client, demo: None, settings: Any) -> None:
    html = admin_client.get(reverse("admin:placement-board")).content.decode()
    assert "<script" not in html.split("</head>", 1)[1].replace('<script src="', "")


def test_a_device_page_explains_its_set_from_a_narrow_read_with_the_same_words(
    admin_client: Client, demo: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device page reads the set's tenant, the nodes and classes, and what books the
    set's resources, not the whole mirror; its explanation is the whole mirror's, word for
    word, for every Lost or Pending set of the demo (the A10 sets of other tenants are not
    read for an H100 set)."""
    from django.utils import timezone

    from binder.mirror import read
    from binder.reports import explanations

    everything = explanations.explanations_now(timezone.now())
    assert len(everything) >= 4
    for key, whole in everything.items():
        assert explanations.explanation_of(key, timezone.now()) == whole, key

    read_devices: list[int] = []
    original = read.read_rows

    def counting(kind: str, *args: Any, **kwargs: Any) -> list[Any]:
        rows = original(kind, *args, **kwargs)
        if kind == "GPU":
            read_devices.append(len(rows))
        return rows

    monkeypatch.setattr(read, "read_rows", counting)
    monkeypatch.setattr(explanations, "read_rows", counting, raising=False)
    lost = models.GpuDevice.objects.get(name="llm-train-a-gpu0")
    html = admin_client.get(reverse("admin:binder_gpudevice_change", args=[lost.pk])).content.decode()
    assert "needs 8 × h100 on one node" in html
    other_resources = models.GpuDevice.objects.exclude(namespace__name="team-nlp").exclude(class_name="h100")
    assert other_resources.exists()
    assert read_devices and sum(read_devices) <= models.GpuDevice.objects.count() - other_resources.count()


def test_the_narrow_read_explains_every_set_of_the_staff_cluster_as_the_whole_read(placed: models.PassRun) -> None:
    from django.utils import timezone

    from binder.reports import explanations

    everything = explanations.explanations_now(timezone.now())
    assert everything
    for key, whole in everything.items():
        assert explanations.explanation_of(key, timezone.now()) == whole, key
