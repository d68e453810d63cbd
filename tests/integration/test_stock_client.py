"""A stock RocketMQ client written by others, ali-ons (pure JavaScript), against the real broker."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

JS = Path(__file__).parent / "js"


def _node_ready() -> str | None:
    if shutil.which("node") is None:
        return "node is not installed (scripts/test.sh installs it)"
    if not (JS / "node_modules" / "ali-ons").is_dir():
        return "ali-ons is not installed: run `npm ci` in tests/integration/js (scripts/test.sh does)"
    return None


pytestmark = pytest.mark.skipif(_node_ready() is not None, reason=_node_ready() or "")


def test_ali_ons_sends_and_consumes_through_txmq(broker):
    proc = subprocess.run(
        ["node", "ali_ons_roundtrip.js", "--namesrv", broker.namesrv, "--topic", "AliOnsTopic", "--count", "10",
         "--timeout-ms", "60000", "--create-topic"],
        cwd=JS, capture_output=True, text=True, timeout=120)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, f"ali-ons failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{broker.log()}"
    final = lines[-1]
    assert final["ok"] is True and final["sent"] == 10
    assert len(final["received"]) == 10
