"""txmq_requests_refused's help is where an operator reads which reasons there are (HELP in the exposition, the
dashboards' legend): every reason the broker counts is named there, or a new guard's refusals show up under a
label nothing explains."""
from __future__ import annotations

import re
from pathlib import Path

from broker.metrics import BrokerMetrics

ROOT = Path(__file__).resolve().parents[2]
# (metrics.refused.labels("busy"), or a connection's on_refuse("header-size") that the broker counts there)
_COUNTED = re.compile(r"""\b(?:refused(?:\.labels)?|on_refuse)\(\s*["']([a-z_-]+)["']""")
# limits.at_most counts its refusals under its counter's name, "-" for "_" (the reason is not spelled at the call)
_AT_MOST = re.compile(r"""\bat_most\(\s*["']([a-z_]+)["']""")


def test_every_refusal_reason_counted_is_named_in_the_metrics_help():
    texts = [path.read_text() for top in ("broker", "protocol") for path in (ROOT / top).rglob("*.py")]
    reasons = {m.group(1) for text in texts for m in _COUNTED.finditer(text)}
    reasons |= {m.group(1).replace("_", "-") for text in texts for m in _AT_MOST.finditer(text)}
    assert {"forwarding", "broker-consume-stats"} <= reasons        # (at_most's, found too)
    assert {"producer-group-mismatch", "busy", "header-size"} <= reasons   # the pattern still finds the calls
    help_text = BrokerMetrics().refused._documentation
    assert sorted(r for r in reasons if r not in re.findall(r"[a-z_-]+", help_text)) == []
