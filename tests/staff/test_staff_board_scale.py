"""The board at scale and for every eye, through the test client:
paged and sortable rows, only problem nodes, free for new units and the largest gap per
class, a compact legend with tenant search, ``?q=`` jumping to a set's page, the palette's
contrast, and the snapshot reused only while the change feed is unchanged."""

from __future__ import annotations

import re

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from binder import models
from gpuplane.staff.board import PAGE_SIZE
from gpuplane.staff.palette import OTHER, PALETTE, contrast

pytestmark = pytest.mark.django_db

BOARD = "admin:placement-board"
H100 = "nvidia.com/H100"


@pytest.fixture
def fleet() -> None:
    """250 H100 nodes of 8 units: node-000 holds 8 (full), node-i holds i % 8 units of
    tenant t{i % 20}'s set vm-{i}; every 10th node is cordoned, every 25th NotReady."""
    tenants = models.Namespace.objects.bulk_create([models.Namespace(name=f"t{i:02d}") for i in range(20)])
    models.GpuClass.objects.create(name="h100", resource_name=H100)
    models.Node.objects.bulk_create(
        [
            models.Node(
                name=f"node-{i:03d}",
                allocatable={H100: 8},
                unschedulable=i % 10 == 5,
                ready=i % 25 != 7,
            )
            for i in range(250)
        ]
    )
    devices = []
    for i in range(250):
        units = 8 if i == 0 else i % 8
        devices.extend(
            models.GpuDevice(
                namespace=tenants[i % 20],
                name=f"g{i}-{j}",
                class_name="h100",
                vm_name=f"vm-{i}",
                phase="Bound",
                node=f"node-{i:03d}",
            )
            for j in range(units)
        )
    models.GpuDevice.objects.bulk_create(devices)


def _nodes(html: str) -> list[str]:
    return re.findall(r'<tr class="node[^"]*" data-node="([^"]+)"', html)


def _get(client: Client, **params: str) -> str:
    response = client.get(reverse(BOARD), params)
    assert response.status_code == 200, response.content[:400]
    return response.content.decode()


def test_rows_are_paged(admin_client: Client, fleet: None) -> None:
    first = _get(admin_client)
    assert _nodes(first) == [f"node-{i:03d}" for i in range(PAGE_SIZE)]
    assert "250 nodes match of 250; rows 1–100" in first and "page 1 of 3" in first
    third = _get(admin_client, page="3")
    assert _nodes(third) == [f"node-{i:03d}" for i in range(200, 250)]
    assert 'rel="prev"' in third and 'rel="next"' not in third
    assert _nodes(_get(admin_client, page="99")) == _nodes(third)  # past the end: the last page


def test_rows_sort_by_free_units_and_state(admin_client: Client, fleet: None) -> None:
    by_free = _nodes(_get(admin_client, sort="-free"))
    # the most free first: nodes with 0 units booked (i % 8 == 0, not node-000), schedulable and Ready
    assert by_free[0] == "node-008"
    least = _nodes(_get(admin_client, sort="free"))
    # free counts nothing on cordoned and NotReady nodes, so they come first with the full node
    assert least[:3] == ["node-000", "node-005", "node-007"]
    worst = _nodes(_get(admin_client, sort="state"))
    assert _nodes(_get(admin_client, sort="-state"))[0] == "node-007"  # NotReady is the worst
    assert worst[0] == "node-000"  # no problem (full is no problem), then by name


def test_only_problem_nodes(admin_client: Client, fleet: None) -> None:
    html = _get(admin_client, problems="1")
    nodes = _nodes(html)
    assert nodes and all(int(n[-3:]) % 10 == 5 or int(n[-3:]) % 25 == 7 for n in nodes)
    assert len(nodes) == 25 + 10  # 25 cordoned, 10 NotReady
    assert "problems=1" in html.split('id="board-pages"')[0].split('id="sort-free"')[0]  # sorting keeps the filter


def test_free_and_the_largest_gap_per_class_count_only_nodes_that_take_new_units(
    admin_client: Client, fleet: None
) -> None:
    html = _get(admin_client)
    gaps = html.split('id="board-gaps"', 1)[1].split("</table>", 1)[0]
    takers = [i for i in range(1, 250) if i % 10 != 5 and i % 25 != 7]
    free = sum(8 - i % 8 for i in takers)
    assert f"<td>{free}</td>" in gaps and "8 on node-008" in gaps
    # a cordoned node's idle units are drawn hatched, not free, and its strip says why
    row = html.split('data-node="node-005"', 1)[1].split("</tr>", 1)[0]
    assert "blocked" in row and "none for new units: cordoned" in row


def test_legend_is_compact_and_tenants_are_searched(admin_client: Client, fleet: None) -> None:
    html = _get(admin_client)
    legend = html.split('id="board-legend"', 1)[1].split("</div>", 1)[0]
    assert legend.count("data-tenant=") == len(PALETTE)
    assert "13 other tenants" in legend
    # a part of a name finds the one tenant; an ambiguous part says which it matches
    assert 'value="t07"' in _get(admin_client, tenant="07")
    response = admin_client.get(reverse(BOARD), {"tenant": "t0"})
    assert response.status_code == 400 and "matches 10 tenants: t00, t01" in response.content.decode()


def test_q_highlights_a_set_and_opens_its_page(admin_client: Client, fleet: None) -> None:
    html = _get(admin_client, q="t10/vm-210")
    assert _nodes(html)[0] == "node-200"  # page 3
    assert "set t10/vm-210: Bound on node-210" in html
    row = html.split('data-node="node-210"', 1)[1].split("</tr>", 1)[0]
    assert row.count(" hl pin") == 210 % 8
    assert 'data-q="t10/vm-210"' in html
    assert "no node or set" in _get(admin_client, q="nobody/none")
    assert _nodes(_get(admin_client, q="node-120"))[0] == "node-100"


@pytest.mark.parametrize("params", [{"sort": "size"}, {"page": "0"}, {"page": "two"}, {"class": "v100"}])
def test_bad_board_parameters_are_a_clear_400(admin_client: Client, fleet: None, params: dict[str, str]) -> None:
    response = admin_client.get(reverse(BOARD), params)
    assert response.status_code == 400
    assert 'id="board-error"' in response.content.decode()


def test_sets_are_separated_and_cells_link_their_node(admin_client: Client, fleet: None) -> None:
    html = _get(admin_client)
    row = html.split('data-node="node-003"', 1)[1].split("</tr>", 1)[0]
    assert '<span class="sg"></span>' in row  # the gap between the set and the free units
    assert f'href="{reverse("admin:index")}nodes/node-003/"' in row


def test_palette_is_colour_blind_safe_with_contrast_on_white() -> None:
    assert len(set(PALETTE)) == len(PALETTE) >= 7
    for colour in (*PALETTE, OTHER):
        assert contrast(colour) >= 3.0, colour
    assert contrast("#F0E442") < 3.0  # Okabe-Ito's yellow: why it is left out


def test_the_snapshot_is_reused_until_the_feed_changes(admin_client: Client, fleet: None) -> None:
    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            _get(admin_client)
        return len(captured)

    cold = queries()
    warm = queries()
    assert warm < cold  # the mirror is not read again: the feed has not moved
    models.Node.objects.filter(name="node-001").update(unschedulable=True)
    # A change is seen at once: the read model follows the feed and re-reads the one
    # changed row, not the mirror.
    assert queries() <= warm + 1
    row = _get(admin_client).split('data-node="node-001"', 1)[1].split("</tr>", 1)[0]
    assert "cordoned" in row
