"""The web read model's first build at the largest scale: time and memory (report only).

Not a test. ``binder.runtime.readmodel`` builds from the same ``MirrorState`` code as the
binder's state; this measures one build in a fresh process (what a web process pays at
start, and what it holds after)::

    .venv/bin/python -m bench.readmodel_scale --database-url postgres://postgres@127.0.0.1:5432/gpuplane_bench_sc
"""

from __future__ import annotations

import argparse
import json
import os
import time

from bench.common import DEFAULT_URL, peak_rss_mib, rss_mib, setup_django


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", default=os.environ.get("BENCH_DATABASE_URL", DEFAULT_URL))
    args = parser.parse_args()
    setup_django(args.database_url, migrate=False)
    from binder.runtime.readmodel import ReadModel

    before = rss_mib()
    model = ReadModel("bench:readmodel")
    clock = time.perf_counter()
    model.current()
    build = time.perf_counter() - clock
    out = {
        "build_s": build,
        "devices": len(model.records["GPU"]),
        "nodes": len(model.records["Node"]),
        "rss_before_mib": before,
        "rss_after_mib": rss_mib(),
        "added_mib": rss_mib() - before,
        "peak_mib": peak_rss_mib(),
        "load_average": os.getloadavg(),
    }
    from binder import models

    models.FeedReader.objects.filter(worker=model.worker).delete()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
