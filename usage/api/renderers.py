"""CSV: the renderer DRF negotiates and the streamed export the views and the admin share."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Iterator
from typing import Any

from django.db.models import QuerySet
from rest_framework.renderers import BaseRenderer

from usage.models import UsageRecord

# -- CSV ------------------------------------------------------------------------------------

#: A cell starting with one of these is a formula to Excel, LibreOffice and Google Sheets
#: (OWASP "CSV injection"): tenants choose VM names, device names and node labels.
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def safe_cell(value: Any) -> Any:
    """``value`` as a spreadsheet shows it, never runs it: text starting like a formula gets a
    leading single quote (OWASP's rule). Numbers are left alone (they are ours, not a tenant's)."""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value


class SafeWriter:
    """``csv.writer`` whose every text cell goes through :func:`safe_cell`: the one way gpuplane
    writes CSV (the usage API, the admin's usage export, the usage chart)."""

    def __init__(self, out: Any, **options: Any) -> None:
        self._writer = csv.writer(out, **options)

    def writerow(self, row: Iterable[Any]) -> Any:
        return self._writer.writerow([safe_cell(v) for v in row])


class CSVRenderer(BaseRenderer):
    """``?format=csv``: the views stream CSV themselves; this only makes DRF accept it."""

    media_type = "text/csv"
    format = "csv"
    charset = "utf-8"

    def render(self, data: Any, accepted_media_type: str | None = None, renderer_context: Any = None) -> bytes:
        # Errors (400/401/404) come through here as dicts: render them as one CSV row.
        out = io.StringIO()
        writer = SafeWriter(out)
        if isinstance(data, dict):
            writer.writerow(["error"])
            # The JSON answer's words: its "detail" alone, or each parameter with its errors.
            detail = data.get("detail") if list(data) == ["detail"] else None
            writer.writerow([str(detail) if detail is not None else _flatten(data)])
        return out.getvalue().encode()


def _flatten(data: Any) -> str:
    if isinstance(data, dict):
        return "; ".join(f"{k}: {_flatten(v)}" for k, v in data.items())
    if isinstance(data, list):
        return ", ".join(_flatten(v) for v in data)
    return str(data)


CSV_COLUMNS = ["id", "namespace", "subjectKind", "subject", "subjectUid", "vmName", "key", "resourceName", "units",
               "node", "phase", "start", "end", "gpuHours", "openedByPass", "closedByPass"]  # fmt: skip


def csv_stream(queryset: QuerySet[UsageRecord]) -> Iterator[str]:
    """The records as CSV, a chunk of rows at a time (constant memory for any export)."""
    buffer = io.StringIO()
    writer = SafeWriter(buffer)
    writer.writerow(CSV_COLUMNS)
    rows = queryset.values_list(
        "id",
        "namespace",
        "subject_kind",
        "subject",
        "subject_uid",
        "vm_name",
        "key",
        "resource_name",
        "units",
        "node",
        "phase",
        "start",
        "end",
        "gpu_hours",
        "opened_by_pass",
        "closed_by_pass",
    )  # type: ignore[misc]  # fmt: skip - gpu_hours is annotated by queries.with_record_hours
    for count, row in enumerate(rows.iterator(chunk_size=2000), 1):
        values = list(row)
        values[11] = values[11].isoformat()
        values[12] = values[12].isoformat() if values[12] else ""
        values[13] = f"{float(values[13]):.6f}"
        writer.writerow(["" if v is None else v for v in values])
        if count % 500 == 0:
            yield buffer.getvalue()
            buffer.seek(0)
            buffer.truncate()
    yield buffer.getvalue()
