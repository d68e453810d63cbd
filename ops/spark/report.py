"""The daily report: one self-contained HTML page (inline SVG charts, no script, no network)
and a CSV summary with one row per hour and one for the day.

collect() pulls the few hundred numbers a day needs from the cached rollup tables;
render_html() / render_csv() are pure functions of that dict.

With several brokers (one store each) the tables hold one row set per broker. The page's
figures are then across the brokers: counts add up, ``max`` is the largest, and the decision
latency percentiles are the highest broker's (an upper bound: exact cross-broker percentiles
would need every latency). A "Brokers" table gives each broker's day, and the CSV's last column,
``broker``, is ``*`` on the across-brokers rows, followed by each broker's own hour and day rows.
"""
from __future__ import annotations

import contextlib
import csv
import html
import io
import os

from .svg import bar_chart, line_chart

CSV_COLUMNS = ("date", "window", "messages", "bytes", "halves", "commits", "rollbacks", "checks", "dead_letters",
               "undecided_at_end", "decided", "latency_p50_ms", "latency_p95_ms", "latency_p99_ms",
               "latency_max_ms", "broker")
TX_COLUMNS = CSV_COLUMNS[4:-1]
ALL_BROKERS = "*"


def combine(rows: list[dict], columns=TX_COLUMNS) -> dict:
    """Several brokers' rows of one window as one: counts add, max and percentiles take the largest."""
    if len(rows) == 1:
        return {c: rows[0].get(c) for c in columns}
    out = {}
    for c in columns:
        values = [r.get(c) for r in rows if r.get(c) is not None]
        if not values:
            out[c] = None
        elif c.startswith("latency_"):
            out[c] = max(values)
        else:
            out[c] = sum(values)
    return out


def _by(rows, key) -> dict:
    groups: dict = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r)
    return groups


def collect(tables: dict, dates: list[str], summary: dict) -> dict[str, dict]:
    """The report's numbers for every date, in five small queries over the cached tables."""
    from pyspark.sql import functions as F

    def rows(df):
        by_date: dict[str, list[dict]] = {d: [] for d in dates}
        for r in df.collect():
            by_date[str(r["date"])].append(r.asDict())
        return by_date

    # Hours come from Spark (UTC session zone): collected timestamps would be in local time.
    hour = F.hour("window_start").alias("h")
    traffic = tables["traffic"]
    hours = rows(traffic.where("grain = 'hour'").groupBy("date", "broker", hour)
                 .agg(F.sum("messages").alias("messages"), F.sum("bytes").alias("bytes")))
    topics = rows(traffic.where("grain = 'day'").groupBy("date", "topic", "topic_kind")
                  .agg(F.sum("messages").alias("messages"), F.sum("bytes").alias("bytes")))
    tx = rows(tables["transactions"].where("producer_group = '*' OR grain = 'day'").withColumn("h", hour))
    lag = rows(tables["consumer_lag"].where("grain = 'day'"))
    broker = rows(tables["broker"].where("grain = 'day'"))
    scan = {k: summary[k] for k in ("records", "segments", "damage", "snapshot_lines", "bad_snapshot_lines",
                                    "incomplete_snapshot_lines")}
    scan["duplicate_snapshot_lines"] = summary.get("duplicate_snapshot_lines", 0)
    scan["early_snapshot_lines"] = summary.get("early_snapshot_lines", 0)
    scan["damaged_ops"] = summary.get("damaged_ops") or {}
    scan["kept_corrupt"] = summary.get("kept_corrupt") or []
    brokers = list(summary.get("brokers") or [])
    out = {}
    for d in dates:
        names = brokers or sorted({r["broker"] for r in hours[d] + tx[d]})
        out[d] = {"date": d, **_window_rows(hours[d], tx[d], names),
                  "per_broker": {b: _window_rows([r for r in hours[d] if r["broker"] == b],
                                                 [r for r in tx[d] if r["broker"] == b], [b])
                                 for b in names} if len(names) > 1 else {},
                  "topics": sorted(topics[d], key=lambda t: (-t["messages"], t["topic"])),
                  "groups": [{"producer_group": g, **combine(rs)} for g, rs in sorted(_by(
                      (r for r in tx[d] if r["grain"] == "day" and r["producer_group"] != "*"),
                      lambda r: r["producer_group"]).items())],
                  "lag": sorted(lag[d], key=lambda r: (-(r["lag_max"] or 0), r["consumer_group"],
                                                       r.get("broker") or "")),
                  "broker": sorted(broker[d], key=lambda r: r.get("broker") or ""),
                  "brokers": names,
                  "scan": scan}
    return out


def _window_rows(hours: list[dict], tx: list[dict], brokers: list[str]) -> dict:
    """The hour rows and the day row of the given traffic and transaction rows (any brokers)."""
    traffic = _by(hours, lambda r: r["h"])
    tx_hours = _by((r for r in tx if r["producer_group"] == "*" and r["grain"] == "hour"), lambda r: r["h"])
    tx_day = [r for r in tx if r["producer_group"] == "*" and r["grain"] == "day"]
    empty = {c: None for c in TX_COLUMNS}
    return {
        "hours": [{"hour": h, "messages": sum(r["messages"] or 0 for r in traffic.get(h, [])),
                   "bytes": sum(r["bytes"] or 0 for r in traffic.get(h, [])),
                   **(combine(tx_hours[h]) if h in tx_hours else empty)} for h in range(24)],
        "day": {"messages": sum(r["messages"] for r in hours), "bytes": sum(r["bytes"] for r in hours),
                **(combine(tx_day) if tx_day else empty)},
    }


def write_reports(report_dir: str, dates: list[str], tables: dict, summary: dict) -> list[str]:
    os.makedirs(report_dir, exist_ok=True)
    paths = []
    for d, data in collect(tables, dates, summary).items():
        for ext, text in (("html", render_html(data)), ("csv", render_csv(data))):
            path = os.path.join(report_dir, f"txmq-{d}.{ext}")
            tmp = path + ".tmp"
            try:
                with open(tmp, "w", encoding="utf-8", newline="") as f:
                    f.write(text)
                os.replace(tmp, path)
            except BaseException:
                # A full disk cut it short: left there, it held the pages that were free (the next night's rollup
                # and the broker's store if they share the disk) until a later run for that date fitted.
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            paths.append(path)
    return paths


def render_csv(data: dict) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    sets = [(ALL_BROKERS, data)] + sorted(data.get("per_broker", {}).items())
    for broker, rows in sets:
        for h in rows["hours"]:
            w.writerow([data["date"], f"{h['hour']:02d}:00"] + [_csv(h.get(c)) for c in CSV_COLUMNS[2:-1]] + [broker])
        w.writerow([data["date"], "day"] + [_csv(rows["day"].get(c)) for c in CSV_COLUMNS[2:-1]] + [broker])
    return out.getvalue()


def _csv(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3f}".rstrip("0").rstrip(".")
    return v


def _num(v, digits: int = 0) -> str:
    if v is None:
        return "–"
    if isinstance(v, float) and digits:
        return f"{v:,.{digits}f}"
    return f"{int(round(v)):,}"


def _mb(v) -> str:
    return f"{(v or 0) / 1e6:,.1f} MB"


def _table(head, body) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    trs = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in body)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>"


def render_html(data: dict) -> str:
    d, day, hours = data["date"], data["day"], data["hours"]
    labels = [f"{h['hour']:02d}" for h in hours]
    charts = [
        ("Hourly throughput (messages in)", bar_chart(
            labels, [("messages", [h["messages"] for h in hours], "#4878a8")], y_label="messages", id="throughput")),
        ("Transaction outcomes per hour", bar_chart(
            labels, [("commits", [h["commits"] or 0 for h in hours], "#3c9a5f"),
                     ("rollbacks", [h["rollbacks"] or 0 for h in hours], "#d08a2e"),
                     ("dead letters", [h["dead_letters"] or 0 for h in hours], "#b33c3c")],
            y_label="transactions", id="outcomes",
            line=("undecided at hour end", [h["undecided_at_end"] or 0 for h in hours], "#6a4c93"))),
        ("Decision latency (half stored to decision stored)", line_chart(
            labels, [("p50", [h["latency_p50_ms"] for h in hours], "#4878a8"),
                     ("p95", [h["latency_p95_ms"] for h in hours], "#d08a2e"),
                     ("p99", [h["latency_p99_ms"] for h in hours], "#b33c3c"),
                     ("max", [h["latency_max_ms"] for h in hours], "#777777")], y_label="ms", id="latency")),
    ]
    tiles = [("messages in", _num(day["messages"])), ("bytes in", _mb(day["bytes"])),
             ("half messages", _num(day["halves"])), ("commits", _num(day["commits"])),
             ("rollbacks", _num(day["rollbacks"])), ("checks", _num(day["checks"])),
             ("dead letters", _num(day["dead_letters"])), ("undecided at day end", _num(day["undecided_at_end"])),
             ("decision p50", _num(day["latency_p50_ms"], 1) + " ms"),
             ("decision p99", _num(day["latency_p99_ms"], 1) + " ms")]
    scan = data["scan"]
    notes = [f"{scan['records']:,} records decoded from {scan['segments']} segments; "
             f"{scan['snapshot_lines']:,} metric snapshots ({scan['bad_snapshot_lines']} bad lines, "
             f"{scan['incomplete_snapshot_lines']} incomplete"
             + (f", {scan['duplicate_snapshot_lines']} read twice and counted once"
                if scan.get("duplicate_snapshot_lines") else "")
             + (f", {scan['early_snapshot_lines']} stamped in seconds, not read"
                if scan.get("early_snapshot_lines") else "") + ")."]
    ops = scan.get("damaged_ops") or {}
    if any(ops.values()):
        notes.append(f"Damaged op records: {ops.get('misnamed', 0)} named another half than their body (taken for "
                     f"the body's), {ops.get('unreadable', 0)} could not be read ({ops.get('unplaced', 0)} naming "
                     f"no half); {ops.get('unsettled', 0)} half messages one may have decided are counted undecided "
                     "until the broker's next start settles them.")
    for kept in scan["kept_corrupt"]:
        notes.append(f"Damaged record the broker kept in place, left out (the records after it were read): "
                     f"{kept['file']} at byte {kept['position']} ({kept['skipped_bytes']:,} bytes)")
    for dmg in scan["damage"]:
        notes.append(f"Damaged tail skipped: {dmg['file']} from byte {dmg['position']} "
                     f"({dmg['skipped_bytes']:,} bytes): {dmg['reason']}")
    parts = [
        f"<h1>txmq daily report — {html.escape(d)} (UTC)</h1>",
        '<div class="tiles">' + "".join(f'<div class="tile"><div class="v">{html.escape(v)}</div>'
                                        f'<div class="k">{html.escape(k)}</div></div>' for k, v in tiles) + "</div>",
    ]
    for title, svg in charts:
        parts.append(f"<h2>{html.escape(title)}</h2>{svg}")
    parts.append("<h2>Hours</h2>" + _table(
        ["hour", "messages", "bytes", "halves", "commits", "rollbacks", "checks", "dead letters", "undecided",
         "p50 ms", "p95 ms", "p99 ms", "max ms"],
        [[f"{h['hour']:02d}:00", _num(h["messages"]), _num(h["bytes"]), _num(h["halves"]), _num(h["commits"]),
          _num(h["rollbacks"]), _num(h["checks"]), _num(h["dead_letters"]), _num(h["undecided_at_end"]),
          _num(h["latency_p50_ms"], 1), _num(h["latency_p95_ms"], 1), _num(h["latency_p99_ms"], 1),
          _num(h["latency_max_ms"])] for h in hours]))
    parts.append("<h2>Topics</h2>" + _table(
        ["topic", "kind", "messages", "bytes"],
        [[t["topic"], t["topic_kind"], _num(t["messages"]), _mb(t["bytes"])] for t in data["topics"]]))
    parts.append("<h2>Producer groups (transactions)</h2>" + _table(
        ["group", "halves", "commits", "rollbacks", "checks", "dead letters", "undecided at day end", "p50 ms",
         "p99 ms", "max ms"],
        [[g["producer_group"], _num(g["halves"]), _num(g["commits"]), _num(g["rollbacks"]), _num(g["checks"]),
          _num(g["dead_letters"]), _num(g["undecided_at_end"]), _num(g["latency_p50_ms"], 1),
          _num(g["latency_p99_ms"], 1), _num(g["latency_max_ms"])] for g in data["groups"]]))
    many = len(data.get("brokers") or []) > 1
    parts.append("<h2>Consumer lag</h2>" + _table(
        ["consumer group"] + (["broker"] if many else []) + ["snapshots", "max lag", "average lag"],
        [[c["consumer_group"]] + ([c["broker"]] if many else []) +
         [_num(c["snapshots"]), _num(c["lag_max"]), _num(c["lag_avg"], 1)] for c in data["lag"]]))
    if data.get("per_broker"):
        parts.append("<h2>Brokers</h2>" + _table(
            ["broker", "messages", "bytes", "halves", "commits", "rollbacks", "undecided at day end", "p99 ms"],
            [[b, _num(r["day"]["messages"]), _mb(r["day"]["bytes"]), _num(r["day"]["halves"]),
              _num(r["day"]["commits"]), _num(r["day"]["rollbacks"]), _num(r["day"]["undecided_at_end"]),
              _num(r["day"]["latency_p99_ms"], 1)] for b, r in sorted(data["per_broker"].items())]))
    for b in data["broker"]:
        who = f"{b['broker']}: " if len(data.get("brokers") or []) > 1 else ""
        parts.append(f"<p>{html.escape(who)}Connections: max {_num(b['connections_max'])}, average "
                     f"{_num(b['connections_avg'], 1)} over {_num(b['snapshots'])} snapshots.</p>")
    parts.append("<h2>Inputs</h2>" + "".join(f"<p>{html.escape(n)}</p>" for n in notes))
    return _PAGE.format(title=html.escape(f"txmq {d}"), body="\n".join(parts))


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 2em auto; max-width: 1000px; color: #222; }}
h1 {{ font-size: 1.5em; }} h2 {{ font-size: 1.15em; margin-top: 2em; }}
.tiles {{ display: flex; flex-wrap: wrap; gap: 8px; }}
.tile {{ border: 1px solid #ddd; border-radius: 6px; padding: 8px 12px; min-width: 120px; }}
.tile .v {{ font-size: 1.3em; font-weight: 600; }} .tile .k {{ color: #666; font-size: .85em; }}
table {{ border-collapse: collapse; font-size: .9em; }}
th, td {{ border-bottom: 1px solid #eee; padding: 3px 8px; text-align: right; }}
th:first-child, td:first-child {{ text-align: left; }}
svg text {{ font: 11px system-ui, sans-serif; fill: #444; }}
</style></head>
<body>
{body}
</body></html>
"""
