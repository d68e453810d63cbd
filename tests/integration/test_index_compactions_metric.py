"""The undecided index's sweeps are on the /metrics page (broker/metrics.py _CompactionCollector)."""
from __future__ import annotations

import asyncio
import urllib.request

from tests.support.bounded import bounded


@bounded(60)
async def test_the_index_sweeps_counter_is_scraped_from_a_running_broker(broker):
    """The counter the changelog and performance notes name, as an operator reads it: a broker that has decided
    nothing under a backlog has swept nothing."""
    def scrape() -> bytes:
        with urllib.request.urlopen(f"http://{broker.metrics}/metrics", timeout=10) as page:
            return page.read()

    page = (await asyncio.to_thread(scrape)).decode()
    [line] = [x for x in page.splitlines() if x.startswith("txmq_transaction_index_compactions_total")]
    assert float(line.split()[-1]) == 0
    assert "# TYPE txmq_transaction_index_compactions_total counter" in page
