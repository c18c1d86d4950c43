"""Benchmark the usage-record write of a pass that binds many orders, index by index.

Not a test. Against a database with a generated cluster whose records a full pass has
opened (``python -m bench.cluster_bench --generate-only`` then ``manage.py run_pass``), it times
what ``binder.runtime.usage_records`` does for a pass that binds ``--rows`` new devices: the open-record
lookup for their subjects (``open_records_of``: one join on arrays) and the COPY of their
new records (``write_plan``). Each run is one transaction that is rolled back, so the
database is left as it was; ``--without`` drops the named indexes inside that transaction
first (DROP INDEX is transactional in PostgreSQL), which compares index sets on the same
table without migrating back and forth.

    .venv/bin/python -m bench.usage_write_bench --database-url postgres://postgres@127.0.0.1:5432/gpuplane_bench
    .venv/bin/python -m bench.usage_write_bench --without usage_open_idx usage_subject_idx
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import UTC, datetime

from bench.common import DEFAULT_URL, setup_django


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default=DEFAULT_URL)
    parser.add_argument("--rows", type=int, default=26_000, help="new records per pass (a 10k-orders pass: 26k)")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--without", nargs="*", default=[], help="indexes to drop (inside the rolled-back run)")
    args = parser.parse_args()
    setup_django(args.database_url, migrate=False)

    from django.db import connection, transaction

    from binder.engine.usage import RecordPhase, SubjectKind, Subjects, UsageHolding, UsagePlan
    from binder.runtime.usage_records import open_records_of, write_plan
    from usage.models import UsageRecord

    table = UsageRecord._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexname FROM pg_indexes WHERE tablename = %s ORDER BY indexname", [table])
        indexes = [row[0] for row in cursor.fetchall()]
    unknown = set(args.without) - set(indexes)
    if unknown:
        raise SystemExit(f"no such index on {table}: {', '.join(sorted(unknown))} (there are: {', '.join(indexes)})")
    open_count = UsageRecord.objects.open().count()
    namespaces = list(UsageRecord.objects.open().order_by().values_list("namespace", flat=True).distinct()[:1000])
    if not namespaces:
        raise SystemExit("no open usage records: run one full pass on the generated cluster first")
    now = datetime.now(UTC)
    plan = UsagePlan(
        open=tuple(
            UsageHolding(
                namespaces[i % len(namespaces)],
                SubjectKind.GPU,
                f"uwbench-{i}-gpu0",
                "",
                "h100",
                "nvidia.com/GH100_H100_SXM5_80GB",
                1,
                f"node-{i % 10000:05d}",
                RecordPhase.BOUND,
                f"uwbench-{i}",
                now,
            )
            for i in range(args.rows)
        )
    )
    subjects = Subjects(device_keys=frozenset((h.namespace, h.subject) for h in plan.open))
    lookups, copies = [], []
    for _ in range(args.runs):
        with transaction.atomic():
            with connection.cursor() as cursor:
                for name in args.without:
                    cursor.execute(f'DROP INDEX "{name}"')
            clock = time.perf_counter()
            found = open_records_of(subjects)
            lookups.append(time.perf_counter() - clock)
            assert not found
            clock = time.perf_counter()
            write_plan(plan, 0, now)
            copies.append(time.perf_counter() - clock)
            transaction.set_rollback(True)
    kept = [name for name in indexes if name not in args.without]
    print(f"{table}: {open_count} open records; indexes kept ({len(kept)}): {', '.join(kept)}")
    print(
        f"open-record lookup for {args.rows} subjects: median {statistics.median(lookups) * 1000:.0f} ms"
        f" (min {min(lookups) * 1000:.0f}); COPY of {args.rows} records: median"
        f" {statistics.median(copies) * 1000:.0f} ms (min {min(copies) * 1000:.0f}); {args.runs} runs"
    )


if __name__ == "__main__":
    main()
