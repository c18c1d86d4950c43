"""One table of mirrored kinds (``binder.kube.kinds.KINDS``): every layer's view of a kind
comes from its row, and what cannot be derived from it (the CRDs, the RBAC rules, the change
feed's triggers, the models) agrees with it, so a kind in one place and not the others fails here."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

import yaml

from binder.engine import types as e
from binder.kube import client, objects
from binder.kube.kinds import BY_KIND, KINDS, Kind
from binder.kube.resources import GROUP

ROOT = Path(__file__).resolve().parents[2]


def test_each_kind_row_names_a_parser_a_model_and_a_converter_that_exist() -> None:
    from binder import models
    from binder.mirror import convert

    cluster_fields = {f.name for f in dataclasses.fields(e.Cluster)}
    for kind in KINDS:
        model = getattr(models, kind.model)
        fields = {f.name for f in model._meta.get_fields()}
        assert set(kind.row_fields) <= fields, (kind.kind, set(kind.row_fields) - fields)
        assert ("namespace" in fields) == kind.namespaced, kind.kind
        assert ("resource_version" in fields) == kind.status_written, kind.kind
        if kind.converter:
            assert callable(getattr(convert, kind.converter)), kind.kind
            assert kind.cluster_field in cluster_fields, kind.kind
        else:
            assert not kind.row_fields and not kind.cluster_field, kind.kind
        assert objects.PARSERS[kind.kind] is kind.parser and objects.GROUPS[kind.kind] == kind.group
        assert client.RESOURCES[kind.kind] is kind


def test_every_layers_table_is_the_kinds_table() -> None:
    from binder import sync
    from binder.mirror import convert, read, write
    from binder.runtime import mirror_state, readmodel, state

    names = [k.kind for k in KINDS]
    assert list(sync.SYNC_ORDER) == names
    assert set(write.MODELS) == set(names) == set(objects.PARSERS) == set(client.RESOURCES)
    engine = {k.kind for k in KINDS if k.converter}
    assert set(read.KINDS) == set(convert.CONVERTERS) == set(mirror_state.ENGINE_KINDS) == engine
    assert set(readmodel.NAMESPACED) == {k.kind for k in KINDS if k.namespaced and k.converter}
    assert {k.kind for k in KINDS if k.status_written} == write.VERSIONED
    assert {k.kind for k in KINDS if k.finalizer} == write.RELEASED_BY_BINDER
    assert {k.kind for k in KINDS if k.recorded} == state.RECORDED_KINDS


def test_the_change_feed_watches_every_mirrored_table_and_no_other() -> None:
    from binder import models

    # 0008 made the feed with the tables of its day; a later migration adding a mirrored
    # table adds its triggers and lists the table in its own FEED_TABLES.
    watched: set[tuple[str, str, bool]] = set()
    for path in sorted((ROOT / "binder" / "migrations").glob("0*.py")):
        migration = importlib.import_module(f"binder.migrations.{path.stem}")
        watched |= set(getattr(migration, "FEED_TABLES", ()))
    expected = {(getattr(models, k.model)._meta.db_table, k.kind, k.namespaced) for k in KINDS}
    assert watched == expected


def _crds() -> dict[str, dict[str, object]]:
    found = {}
    for path in sorted((ROOT / "deploy" / "base" / "crds").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                found[doc["spec"]["names"]["kind"]] = doc
    return found


def test_gpuplanes_own_kinds_are_exactly_the_crds_with_their_plural_scope_and_version() -> None:
    crds = _crds()
    own = {k.kind: k for k in KINDS if k.group == GROUP}
    assert set(crds) == set(own)
    for name, crd in crds.items():
        kind: Kind = own[name]
        spec = crd["spec"]
        assert isinstance(spec, dict)
        assert spec["names"]["plural"] == kind.plural
        assert spec["scope"] == ("Namespaced" if kind.namespaced else "Cluster")
        assert [v["name"] for v in spec["versions"]] == [kind.version]
        assert ("status" in spec["versions"][0].get("subresources", {})) == kind.status_written


def test_rbac_lets_the_sync_list_and_watch_every_kind_and_patch_the_finalized_and_status_written() -> None:
    granted: set[tuple[str, str, str]] = set()
    for doc in yaml.safe_load_all((ROOT / "deploy" / "base" / "rbac.yaml").read_text()):
        if doc and doc.get("kind") in ("ClusterRole", "Role"):
            for rule in doc["rules"]:
                granted |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    for kind in KINDS:
        assert {(kind.group, kind.plural, "list"), (kind.group, kind.plural, "watch")} <= granted, kind.kind
        if kind.finalizer:
            assert (kind.group, kind.plural, "patch") in granted, kind.kind
        if kind.status_written:
            assert (kind.group, f"{kind.plural}/status", "patch") in granted, kind.kind
            assert (kind.group, kind.plural, "get") in granted, kind.kind


def test_a_kind_is_looked_up_by_name_in_one_place() -> None:
    assert {k.kind: k for k in KINDS} == BY_KIND and len(BY_KIND) == len(KINDS)
