"""The admin list (TXMQ_LIST_TRANSACTIONS) at a large backlog: its loop time and answer size.

    python bench/bench_admin_list.py N [LIMIT]   (e.g. 100000 1000; 500000 1000000000)

Fills a TransactionCore with N undecided transactions of 10 producer groups (as a check pass would keep them: the
service's describe runs on a stub service, no broker, no socket), then times one request's work in its
processor (describe, the group's total, the JSON body) for all groups and for one group, and prints the
body size. The loop is blocked for all of it: that is what another client waits. The last line is JSON: the
figures and "ratio" = the all-groups list's CPU / the CPU of adding the N transactions (the same run's baseline);
"page_ratio" = the loop hold of the last page (``--after``) / the all-groups (first, unpaged) list's CPU.
"""
import json, os, sys, time, types
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from broker.transaction.check import Policy
from broker.transaction.core import TransactionCore, Tx
from broker.processors.transaction import list_transactions
from broker.transaction.service import TransactionService
from protocol.codes import RequestCode
from protocol.command import RemotingCommand
from bench_admin_tables import drive     # (bench/ is this script's own directory on sys.path)

n = int(sys.argv[1])
limit = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
core = TransactionCore(Policy(60_000, 6 * 3600_000, 15, 72 * 3600_000), lambda off: None)
t0 = time.process_time()
for off in range(n):
    core.add(Tx(off * 300, off, f"PG{off % 10}", "T", f"U{off:032X}", 1_700_000_000_000 + off, owner_id=f"10.0.0.{off % 10}@1"))
fill_cpu = time.process_time() - t0
clients = types.SimpleNamespace(producer_channels=lambda group: [], left_group=lambda conn, group: False)
ctx = types.SimpleNamespace(clock=lambda: 1_800_000_000_000, monotonic=lambda: 0, clients=clients)
svc = types.SimpleNamespace(ctx=ctx, core=core, pending=core.pending)
svc._sender = types.MethodType(TransactionService._sender, svc)
svc.describe = types.MethodType(TransactionService.describe, svc)
svc.dead_count = 0
ctx.tx, ctx.config = svc, types.SimpleNamespace(broker_role="ASYNC_MASTER")
fig = {"n": n, "limit": limit, "fill_cpu_ms": round(fill_cpu * 1000, 1)}
for group in (None, "PG3"):
    cmd = RemotingCommand.request(RequestCode.TXMQ_LIST_TRANSACTIONS, {"group": group, "limit": limit})
    t0 = time.process_time()
    body = list_transactions(ctx, None, cmd).body_bytes()
    cpu = time.process_time() - t0
    print(f"n={n} limit={limit} group={group}: {cpu * 1000:.1f} ms CPU on the loop, body {len(body) / 1e6:.2f} MB"
          f", {getattr(core, 'examined', '?')} entries examined")
    fig[f"{group or 'all'}_cpu_ms"], fig[f"{group or 'all'}_body_bytes"] = round(cpu * 1000, 1), len(body)
    if hasattr(core, "examined"):
        core.examined = 0


def paged(fields):
    """A page (the request names "after"): its coroutine driven step by step, each step what the loop is held."""
    return drive(list_transactions(ctx, None, RemotingCommand.request(RequestCode.TXMQ_LIST_TRANSACTIONS, fields)))


# Pages: the first, one half-way, the last; and a group whose one lies behind all the others' (a walk to it).
core.add(Tx(n * 300, n, "RARE", "T", "URARE", 1_700_000_000_000 + n, owner_id="10.0.0.1@1"))
for name, fields in (("page_first", {"after": -1}), ("page_mid", {"after": n // 2}),
                     ("page_last", {"after": n - limit}), ("page_rare", {"after": -1, "group": "RARE"})):
    resp, steps = paged({"limit": limit, **fields})
    data = json.loads(resp.body_bytes())
    print(f"n={n} limit={limit} {name}: {len(data['pending'])} rows, {sum(steps) * 1000:.1f} ms CPU in "
          f"{len(steps)} steps, the longest {max(steps) * 1000:.1f} ms")
    fig[f"{name}_cpu_ms"], fig[f"{name}_hold_ms"] = round(sum(steps) * 1000, 1), round(max(steps) * 1000, 1)
fig["ratio"] = round(fig["all_cpu_ms"] / fig["fill_cpu_ms"], 4) if fig["fill_cpu_ms"] else None
fig["page_ratio"] = round(fig["page_last_hold_ms"] / fig["all_cpu_ms"], 4) if fig["all_cpu_ms"] else None
print(json.dumps(fig))
