"""txmq_requests_refused's help is where an operator reads which reasons there are (HELP in the exposition, the
dashboards' legend): every reason the broker counts is named there, or a new guard's refusals show up under a
label nothing explains."""
from __future__ import annotations

import re
from pathlib import Path

from broker.metrics import BrokerMetrics

BROKER = Path(__file__).resolve().parents[2] / "broker"
_COUNTED = re.compile(r"""\brefused(?:\.labels)?\(\s*["']([a-z_-]+)["']""")


def test_every_refusal_reason_counted_is_named_in_the_metrics_help():
    reasons = {m.group(1) for path in BROKER.rglob("*.py") for m in _COUNTED.finditer(path.read_text())}
    assert {"producer-group-mismatch", "busy"} <= reasons            # the pattern still finds the calls
    help_text = BrokerMetrics().refused._documentation
    assert sorted(r for r in reasons if r not in re.findall(r"[a-z_-]+", help_text)) == []
