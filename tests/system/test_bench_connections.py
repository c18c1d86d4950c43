"""A bench on the shared PostgreSQL server checks for free connections before it starts, and
stops saying how many there are, rather than failing mid-run on ``too many clients``."""

from __future__ import annotations

import pytest

from bench.common import require_connections
from harness import workers


def test_a_bench_stops_before_it_starts_when_the_server_has_too_few_connections_free(postgres_only: None) -> None:
    url = workers.database_url()
    free = require_connections(url, 1)
    assert free >= 1
    with pytest.raises(SystemExit) as stopped:
        require_connections(url, free + 1000)
    message = str(stopped.value)
    assert "connections free" in message and f"needs about {free + 1000}" in message
    assert "max_connections" in message
