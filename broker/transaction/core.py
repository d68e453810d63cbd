"""The transaction rules, once: a state machine with no asyncio, no I/O and no clock of its own.

The service (service.py) feeds it events and performs the actions it returns:

    event                               what the core answers
    half stored                         schedule the first check (immunity, CHECK_IMMUNITY_TIME_IN_SECONDS)
    END COMMIT/ROLLBACK (any origin)    Write(tx, op)  | Reply (duplicate, conflict, unknown half) | Wait
    END UNKNOWN                         Reply "recorded"; the check schedule stands (decided or unknown
                                        half: what became of it, never "will check back")
    the decision written / failed       the transaction leaves the index / stays pending, still scheduled
    due(now)                            SendCheck(tx, channel) | Write(tx, DEAD, "max-checks") | defer
                                        | Write(tx, DEAD, "uncheckable-half") (no group or topic in its half)
    a producer of the group joins       its deferred transactions are due now; its parked ones may go
    check written / failed              next check after the interval, 2x / 4x while unanswered
    resume (admin, of a dead letter)    pending again, checks reset
    recovered                           pending with its check count, due no earlier than now, nor than an
                                        interval after its last check record

Every time the core is given is the schedule's clock (the service's is monotonic), except Tx.store_ts,
the store timestamp (the wall clock's), kept for ages and reports.

States of a transaction (docs/design.md, "Transaction state machine"):

    PENDING --END/check answer/admin/max-checks/expiry--> DECIDING(op) --written--> COMMITTED | ROLLED_BACK | DEAD
    DECIDING --write failed--> PENDING          DEAD --resume--> PENDING

The first decision wins: while one is being written, every other decision waits for it (Wait), then
finds the transaction decided and is acknowledged when it is the same decision or refused when it is
not. Decided transactions are not kept here: ``decided(half_offset)`` looks them up (the service reads
its decision table, one byte a transaction on disk).
"""
from __future__ import annotations

import heapq
import weakref
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Iterator

from protocol.codes import ResponseCode
from protocol.message import TIMER_PROPS, Prop, tags_code, validate_topic

from .check import Policy, first_check_time, next_check_after_check
from protocol.txlog import COMMIT, DEAD, P_OWNER, RESUME, ROLLBACK, plain_owner

UNKNOWN = "UNKNOWN"
NO_HALF = "Find prepared transaction message failed"      # (RocketMQ's remark: no half at the offset)
_BUCKET = 1024      # half-queue offsets a bucket of the floor's index spans (TransactionCore.lowest_queue_offset)
UNCHECKABLE = "uncheckable-half"   # the dead-letter reason of a half naming no producer group or real topic
DECISIONS = (COMMIT, ROLLBACK, DEAD)


class Origin(Enum):
    PRODUCER = "producer"        # END_TRANSACTION after the local transaction
    CHECK = "check"              # END_TRANSACTION answering a check (fromTransactionCheck)
    ADMIN = "admin"              # txmq admin resolve
    MAX_CHECKS = "max-checks"    # the core itself, after transaction_check_max checks
    EXPIRY = "expiry"            # retention: the half's segment is going (a reason is given)
    DAMAGE = "damage"            # the half's record is damaged: it cannot be checked (a reason is given)


@dataclass(slots=True, eq=False)
class Tx:
    """An undecided transaction: what its checks and decisions need, never the payload."""

    half_offset: int
    queue_offset: int
    group: str
    topic: str
    uniq_key: str
    store_ts: int
    real_qid: int = 0
    stored_at: int = 0           # when it was stored by the schedule's clock (add): what its age is judged by
    tags_code: int = 0
    next_check: int = 0
    checks: int = 0
    checked_at: int = 0          # when its last check record was written, by the wall clock (0: none known): a
                                 # restart schedules its next check from it (add), as the snapshot keeps it
    unanswered: int = 0          # consecutive checks without an answer: they stretch the interval
    awaiting: bool = False       # a check was sent and not answered yet
    last_answer: str = ""
    deciding: str | None = None  # the decision being written
    owner: object = None         # the producer connection that sent the half (opaque here): a weakref.ref to
                                 # it from the service (see owner_of), so a closed one is not kept alive
    owner_id: str = ""
    asked_seq: int = 0           # its sender's connection gone: the claimant of its id last asked (Channel.seq)
    delayed: bool = False        # DELAY / TIMER_* properties: once committed it waits (broker/schedule)
    check_channel: object = None  # where its check went: it holds one of that channel's check slots (in_flight)
    rerouted: str = ""           # why its check went to another producer than its sender ("": to the sender)
    reask: bool = False          # due at once: its check was lost with its connection (channel_closed)
    reasking: bool = False       # its check is such a re-ask: lost again, it waits its schedule (see _lost)
    parked: bool = False         # due, but every producer of its group has its checks in flight (see due)
    deferred: bool = False       # due with no producer of its group here: rescheduled an interval on (see due)
    requeued: int = 0            # its COMMIT went to real_qid mod this (its topic's read queues, cut since): counted


def owner_of(tx: Tx):
    """The connection that sent ``tx`` while it is alive, else None. The service keeps a weak reference in
    ``tx.owner``: a strong one kept every closed connection whose halves were still undecided, whole (transport,
    buffers, handler: 13 KB each), for as long as they were (a client sending one half a connection, +14 MB of
    RSS a thousand). An open connection is held by its transport, so it is never lost while it could be asked."""
    owner = tx.owner
    return owner() if isinstance(owner, weakref.ref) else owner


_DELAY_KEYS = (Prop.DELAY, *TIMER_PROPS)


def asks_delay(props: dict) -> bool:
    """DELAY / TIMER_* properties: once committed, the message waits in broker/schedule."""
    return any(props.get(k, "0") != "0" for k in _DELAY_KEYS)


def tx_from_half(msg, checks: int = 0, owner_id: str = "") -> Tx:
    """An undecided transaction as its stored half message describes it; ``owner_id`` is the client id of the
    producer that sent it when known better than the half's TXMQ_OWNER (the one a later heartbeat gave its
    connection, which a check record or the snapshot kept), else the half's."""
    props = msg.properties
    if not owner_id:
        owner_id = props.get(P_OWNER, "")
        if owner_id and not plain_owner(owner_id):
            owner_id = ""       # a producer's own, on a half stored before the broker dropped it: up to 32 KiB
    try:
        real_qid = int(props.get(Prop.REAL_QID, "0") or 0)
    except ValueError:
        real_qid = 0
    topic = props.get(Prop.REAL_TOPIC, "")
    if validate_topic(topic) is not None:
        # Not a name a send could have given (every topic a half can be sent to passes it): a tear that zeroed the
        # properties from inside the topic's name on. Taken as naming no topic (UNCHECKABLE when due): asked, its
        # producer's COMMIT was refused by the store (MESSAGE_ILLEGAL) each check, up to the limit.
        topic = ""
    return Tx(msg.physical_offset, msg.queue_offset, props.get(Prop.PGROUP, ""), topic,
              props.get(Prop.UNIQ_KEY, ""), msg.store_timestamp, real_qid=real_qid, tags_code=tags_code(props),
              checks=checks, delayed=asks_delay(props), owner_id=owner_id)


@dataclass(frozen=True, slots=True)
class Reply:
    """Answer the request; ``event`` names what happened, for the metrics."""

    code: int
    remark: str
    event: str = ""


@dataclass(frozen=True, slots=True)
class Write:
    """Append the records of ``op`` for ``tx``; then call written()."""

    tx: Tx
    op: str
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class Wait:
    """A decision for ``tx`` is being written: ask again once it is (the first decision wins)."""

    tx: Tx


# What ``channel_for`` answers when the group has producers but each has ``in_flight`` checks it has not
# answered up to its cap (or stopped reading): the transaction waits, no check spent, until one has room.
BUSY = object()


@dataclass(frozen=True, slots=True)
class SendCheck:
    """Append a check record (attempt ``tx.checks``), then send CHECK_TRANSACTION_STATE on ``channel``."""

    tx: Tx
    channel: object


class TransactionCore:
    """Undecided transactions ordered by their next check, a schedule per producer group taken in turn; every rule
    of the transaction lifecycle."""

    _NEXT_SLACK = 64    # stale entries _next may hold beyond two per group before it is rebuilt (see _push)
    _OFFER_ALL_MS = 1_000   # how often every group with parked transactions is offered room (see _roomy)
    _SCHED_SLACK = 1024     # stale entries a group's schedule may hold beyond two per pending one (see _push)
    _AGE_SLACK = 1024       # the same for a group's age heap (see _age)
    _SWEEP = 64             # heap positions a push over the bound examines for stale entries (see _sweep)

    def __init__(self, policy: Policy, decided: Callable[[int], str | None],
                 half_of: Callable[[int], tuple[str, int] | None] | None = None):
        self.policy = policy
        self.decided = decided                  # half offset -> COMMIT/ROLLBACK/DEAD or None
        self.half_of = half_of                  # half offset -> (its producer group, its queue offset) or None
        self.pending: dict[int, Tx] = {}
        # The check schedule, one per producer group, taken in turn (due): from one schedule, oldest due first, a
        # group's backlog (100,000 due at once, its producer hung or gone) was popped and parked whole before the
        # due check of another group was reached, 350-550 ms later and longer the larger the backlog.
        self._sched: dict[str, list[tuple[int, int]]] = {}      # group -> lazy heap of (next check, half offset)
        # Groups by the earliest of their schedule (lazy: an entry's time is at most its group's earliest), but for
        # those in _turn: the groups found due, served one transaction at a time, in turn, across calls.
        self._next: list[tuple[int, str]] = []
        self._turn: deque[str] = deque()
        self._turning: set[str] = set()
        # The groups in _turn by the earliest of their schedule (lazy as _next): next_due, asked for every half
        # stored (add), read each of them, 6 ms a half with 10,000 groups due (a restart, producers hung or gone).
        self._turn_next: list[tuple[int, str]] = []
        self.taken = 0      # due entries taken so far (due): the work of check passes, for tests and benches
        self._by_age: dict[str, list[tuple[int, int]]] = {}     # group -> heap of (Tx.stored_at, half offset)
        self._by_age_entries = 0
        self.compactions = 0    # lazy heaps rebuilt or swept of their decided entries (_push, _age): for the metrics
        # group -> the next position of its schedule (age heap) to examine, while a sweep of it is under way (_sweep)
        self._sched_sweep: dict[str, int] = {}
        self._age_sweep: dict[str, int] = {}
        self.examined = 0   # age-heap entries read by oldest (the admin list): its work, for tests and benches
        # The floor each check pass saves (lowest_queue_offset) was a scan of the whole index, 45 ms on the loop at
        # 500k undecided. Every pending transaction is kept by half-queue offset in buckets of _BUCKET offsets
        # ({bucket: {half offset: queue offset}}, exact: a transaction leaves its bucket as it leaves the index),
        # with a lazy heap of the bucket numbers: the floor is the least of the lowest bucket. Not a lazy heap of
        # every transaction: the entries of newer ones decided under an old backlog never reached its top, and it
        # was rebuilt from a walk of the whole index each time they outnumbered the live ones (200-500 ms at 500k).
        self._by_queue: dict[int, dict[int, int]] = {}
        self._buckets: list[int] = []
        # group -> its number of pending transactions, kept as the index changes: the undecided limit read it
        # by counting the whole index once a second while halves arrived (90 ms on the loop at 500k).
        self.per_group: dict[str, int] = {}
        # Checks sent and not yet answered, per channel ({half offset: Tx}): a check holds its channel's slot from
        # the channel's choice until the transaction is answered, decided, or comes due again (the check was lost),
        # or the channel closes (channel_closed: asked again at once, not an interval on).
        self.checking: dict[object, dict[int, Tx]] = {}
        # The same, counted per (channel, producer group): the cap of checks in flight is a channel's per group, as
        # a Java process queues each producer's checks apart on the connection its producers share (see in_flight).
        self._held: dict[tuple[object, str], int] = {}
        # Check slots given back so far (_release): a caller that noted a group's producers all at their cap
        # (the service, for the rest of a check slice) knows by it that one may have room again. A slice frees
        # slots itself: a transaction due again gives back its unanswered check's slot before it is placed.
        self.released = 0
        # channel -> {producer group: checks of that group it left unanswered since it last answered one}: a
        # producer hung with its connection open. Round-robin asked it as often as one that answers, and each check
        # it took waited a (doubled) interval before going to another: with 25 of 50 producers hung the last
        # transaction was decided after 46 s. The service asks a silent producer only when no other has room.
        self.silent: dict[object, dict[str, int]] = {}
        self.newly_silent: list[tuple[object, str]] = []   # (channel, group) gone silent since the service looked
        self._parked: dict[str, deque[Tx]] = {}    # group -> due transactions waiting for a check slot
        # The groups of _parked that may have room since they were last offered it (a slot of theirs given back, a
        # producer joined, a connection of theirs closed, a slice short of bytes): a pass offers room to those alone.
        # Offered to every group with parked transactions, one room_for call each, it cost 2-5 ms a pass with 10,000
        # of them, and a client answering checks quickly ends a pass at every slice (each answer wakes the timer).
        # Every group is offered it once each _OFFER_ALL_MS too, for room nothing here sees come (a producer reading
        # again, or leaving its group).
        self._roomy: set[str] = set()
        self._all_offered: int | None = None
        # group -> {half offset: Tx} deferred (due, nobody of the group to ask): what producer_joined makes due
        # now, without scanning every pending transaction. An entry leaves when its transaction comes due
        # again or is decided; producer_joined moves the group's whole dict to _waking, in O(1).
        self._deferred: dict[str, dict[int, Tx]] = {}
        # (join time, deferred of the group that joined): put back on the schedule by due(), ``limit`` a call,
        # so 50000 of them cost a join nothing and a check pass no more than its slices.
        self._waking: deque[tuple[int, dict[int, Tx]]] = deque()

    # ------------------------------------------------------------ the index
    def add(self, tx: Tx, now: int | None = None, immunity_s: str | None = None, stored_at: int | None = None,
            checked: int | None = None) -> bool:
        """A half is stored (or recovered, ``now`` given): index it. True when it is now the earliest due.

        ``stored_at``: when the half was stored by the schedule's clock, when that is not the clock of
        ``tx.store_ts`` (the service schedules by the monotonic clock; store times are the wall clock's).
        ``checked``: when a recovered transaction was last checked, by the schedule's clock: its next check is an
        interval after it. Due at once instead, each restart spent a check: a broker restarted five times in a
        minute asked a producer five times in that minute, and one in a crash loop dead-lettered a transaction
        whose local transaction was still running after check_max restarts, not check_max intervals."""
        tx.stored_at = tx.store_ts if stored_at is None else stored_at
        tx.next_check = first_check_time(self.policy, tx.stored_at, immunity_s)
        if checked is not None:
            tx.next_check = max(tx.next_check, checked + self.policy.check_interval_ms)
        if now is not None:
            tx.next_check = max(tx.next_check, now)
        earliest = self.next_due()
        self._put(tx)
        self._push(tx.group, tx.next_check, tx.half_offset)
        self._age(tx)
        return earliest is None or tx.next_check <= earliest

    def _put(self, tx: Tx) -> None:
        self.withdraw(tx.half_offset)
        self.pending[tx.half_offset] = tx
        self.per_group[tx.group] = self.per_group.get(tx.group, 0) + 1
        b = tx.queue_offset // _BUCKET
        members = self._by_queue.get(b)
        if members is None:
            members = self._by_queue[b] = {}
            heap = self._buckets
            if len(heap) > 2 * len(self._by_queue) + 64:
                # Numbers of buckets emptied since: rebuilt from those there are (a few per _BUCKET pending), here
                # and not only as the floor is read, so a burst between two passes cannot pile them up.
                heap = self._buckets = list(self._by_queue)
                heapq.heapify(heap)
            else:
                heapq.heappush(heap, b)
        members[tx.half_offset] = tx.queue_offset

    def withdraw(self, half_offset: int) -> None:
        """``half_offset`` leaves the index (decided, or its resume was refused by the store)."""
        tx = self.pending.pop(half_offset, None)
        if tx is None:
            return
        left = self.per_group[tx.group] - 1
        if left:
            self.per_group[tx.group] = left
        else:
            del self.per_group[tx.group]
        b = tx.queue_offset // _BUCKET
        members = self._by_queue[b]
        del members[half_offset]
        if not members:
            del self._by_queue[b]

    def _age(self, tx: Tx) -> None:
        """``tx``, just put in the index, on its group's age heap."""
        group = tx.group
        heap = self._by_age.setdefault(group, [])
        if group in self._age_sweep or len(heap) > 2 * self.per_group.get(group, 0) + self._AGE_SLACK:
            # Compacted on a read (_age_heaps) too, but that is a metrics scrape or an admin list: without them,
            # the heaps kept every decision's entry as the schedule did (_push). Swept a slice a push, as it is.
            self._by_age_entries -= self._sweep(heap, group, self._age_sweep, False)
        heapq.heappush(heap, (tx.stored_at, tx.half_offset))
        self._by_age_entries += 1

    def lowest_queue_offset(self) -> int | None:
        """The half-queue offset of the oldest-stored pending transaction, or None when none is pending.

        The least of the lowest non-empty bucket (at most _BUCKET transactions), its number found on a lazy heap
        of bucket numbers: O(_BUCKET + log b) a call, never a walk of the index. The heap holds a number again
        each time its bucket is emptied and filled (the newest one, as transactions come and are decided): it
        is rebuilt from the buckets there are, a few per _BUCKET pending, when those outnumber them (_put)."""
        by_queue, heap = self._by_queue, self._buckets
        while heap:
            members = by_queue.get(heap[0])
            if members:
                return min(members.values())
            heapq.heappop(heap)
        return None

    def between(self, lo: int, hi: int) -> list[Tx]:
        """The pending transactions whose half is stored in commit-log range [lo, hi), in log order.

        Read off the buckets by half-queue offset, lowest first: the half queue is one queue, so a later
        bucket's halves lie later in the log, and the walk ends at the first bucket past ``hi``. Retention
        asks for its oldest segment's, at the bottom: O(the transactions up to ``hi`` + k log b), k the buckets
        read. A walk of the whole index was 20-30 ms on the loop at 500k undecided, twice for each segment
        removed. The buckets come off the lazy heap of their numbers (lowest_queue_offset's), popped and pushed
        back: sorted whole each call, a sparse backlog (one undecided half in 2,000, a bucket each) cost as much
        as that walk (73 ms at 500k). Stale numbers popped stay gone, as there; a live one is pushed back once."""
        by_queue, heap, out = self._by_queue, self._buckets, []
        taken: list[int] = []
        try:
            while heap:
                b = heapq.heappop(heap)
                members = by_queue.get(b)
                if not members or (taken and taken[-1] == b):       # emptied, or a second entry of one read
                    continue
                taken.append(b)
                if min(members) >= hi:
                    break
                out += [self.pending[off] for off in sorted(members) if lo <= off < hi]
        finally:
            for b in taken:
                heapq.heappush(heap, b)
        return out

    def oldest_by_group(self) -> dict[str, int]:
        """{producer group: when its oldest undecided half was stored (ms), by the schedule's clock (Tx.stored_at)}.

        Lazy heaps: a decided half leaves its entry behind until it reaches the top, so a read
        costs O(log n) per decided entry; a group's heap is swept a slice a push once its stale entries
        outnumber the live ones (_age), and all are rebuilt here when they still do in all (_age_heaps)."""
        return {group: heap[0][0] for group, heap in self._age_heaps().items()}

    def _age_heaps(self) -> dict[str, list[tuple[int, int]]]:
        """The age heaps, each with a live entry on top, rebuilt when stale entries outnumber the live ones."""
        pending = self.pending
        if self._by_age_entries > 2 * len(pending) + 1024:
            self._rebuild_age()
        for group, heap in list(self._by_age.items()):
            while heap and (heap[0][1] not in pending or pending[heap[0][1]].group != group):
                heapq.heappop(heap)
                self._by_age_entries -= 1
            if not heap:
                del self._by_age[group]
                self._age_sweep.pop(group, None)
        return self._by_age

    def _rebuild_age(self) -> None:
        """The age heaps from the pending index: no stale entry left (O(n))."""
        self._by_age = {}
        self._age_sweep.clear()
        for tx in self.pending.values():
            self._by_age.setdefault(tx.group, []).append((tx.stored_at, tx.half_offset))
        for heap in self._by_age.values():
            heapq.heapify(heap)
        self._by_age_entries = len(self.pending)
        self.compactions += 1

    def stored_after(self, after: int, group: str | None = None) -> Iterator[Tx | None]:
        """The pending transactions whose half-queue offset is past ``after`` (of ``group``, or of every group),
        lowest first: the order their halves were stored, so a caller pages through any backlog by the last
        queue offset it was given (the admin list's cursor). Each one of another group is yielded as None, so a
        caller can pace a long walk. Read off the buckets by half-queue offset from ``after``'s on, each read
        afresh as it is reached: the index may change between two steps (what left it is not yielded).

        Each bucket number looked at while they are found is yielded as None too: a sparse backlog (one
        undecided half in 2,000, a bucket each) had them all filtered and sorted before the first row, in one
        hold of the caller's loop (~100 ms at 500,000 undecided, at every page)."""
        by_queue, pending = self._by_queue, self.pending
        first = max(after + 1, 0) // _BUCKET
        numbers = []
        for b in list(by_queue):        # (a copy: the index changes while the caller yields)
            if b >= first:
                numbers.append(b)
            yield None
        numbers.sort()                  # (nearly sorted as the buckets were made: one pass)
        for b in numbers:
            for off in sorted(by_queue.get(b, ())):     # a bucket's halves in log order are in queue order
                tx = pending.get(off)
                if tx is not None and tx.queue_offset > after:
                    yield tx if group in (None, tx.group) else None

    def oldest(self, group: str | None, limit: int) -> list[Tx]:
        """Up to ``limit`` pending transactions (of ``group``, or of every group), oldest stored first.

        Read off the age heaps, leaving them as they are (but for stale tops): a heap's least entry is its root and an entry's children
        are each later, so the ``limit`` least of them are found from the root down, a candidate heap seeded
        with each group's root (O((limit + groups + stale) log) a call, ``examined`` counts the entries read;
        past 4 * limit + 1024 stale entries read, the heaps are rebuilt, O(n), and read again).
        A sort of the whole index was 90-115 ms on the loop at 500k undecided, each time an operator listed."""
        # (Stale entries are read too, those of decided transactions older than the last listed: the heaps are
        # rebuilt first when they outnumber the live ones, as they were only when the metrics were scraped.)
        # Stale entries under a live top (decided after an old one that stays undecided) are never popped, and
        # short of twice the live ones never rebuilt: 500k of them were read at each list. Past 4 per row wanted
        # (and 1024), the heaps are rebuilt and read again: at most one O(n) rebuild a list, as the sort was.
        out = self._oldest(group, limit, 4 * limit + 1024)
        if out is None:
            self._rebuild_age()
            out = self._oldest(group, limit, None)
        return out

    def _oldest(self, group: str | None, limit: int, stale_max: int | None) -> list[Tx] | None:
        """oldest(), or None when more than ``stale_max`` stale entries were read."""
        pending, heaps = self.pending, self._age_heaps()
        if group is not None:
            heaps = {group: heaps[group]} if group in heaps else {}
        stale = 0
        front = [(h[0], 0, g) for g, h in heaps.items() if h]
        heapq.heapify(front)
        out: list[Tx] = []
        seen: set[int] = set()      # a resumed transaction is on its heap twice
        while front and len(out) < limit:
            (_, off), i, g = heapq.heappop(front)
            self.examined += 1
            tx = pending.get(off)
            if tx is not None and tx.group == g and off not in seen:
                seen.add(off)
                out.append(tx)
            else:
                stale += 1
                if stale_max is not None and stale > stale_max:
                    return None
            h = heaps[g]
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(h):
                    heapq.heappush(front, (h[child], child, g))
        return out

    def _reschedule(self, tx: Tx, when: int) -> None:
        tx.next_check = when
        self._push(tx.group, when, tx.half_offset)

    def _push(self, group: str, when: int, off: int) -> None:
        heap = self._sched.get(group)
        if heap is None:
            heap = self._sched[group] = []
        if not heap or when < heap[0][0]:
            if group in self._turning:
                self._turn_push(when, group)
            else:
                if len(self._next) > 2 * len(self._sched) + self._NEXT_SLACK:  # of groups since served or emptied
                    self._next = [(h[0][0], g) for g, h in self._sched.items() if h and g not in self._turning]
                    heapq.heapify(self._next)
                heapq.heappush(self._next, (when, group))
        if group in self._sched_sweep or len(heap) > 2 * self.per_group.get(group, 0) + self._SCHED_SLACK:
            # A decided transaction's entry is dropped only once it reaches the top: under an older undecided one
            # (a backlog, its check hours off) it never did, and the schedule kept a pair for every decision since,
            # ~150 B each, as much again on the age heaps (the broker's RSS grew 100 MiB over 200k, ~500 B a
            # decision). Swept when stale entries outnumber the live ones, a slice a push.
            self._sweep(heap, group, self._sched_sweep, True)
        heapq.heappush(heap, (when, off))

    def _sweep(self, heap: list[tuple[int, int]], group: str, cursors: dict[str, int], sched: bool) -> int:
        """The next _SWEEP positions of ``group``'s lazy heap (its schedule when ``sched``, else its age heap),
        from the last one down, cleared of the entries of transactions decided (or checked again later, on the
        schedule): the number removed. A sweep goes on at each push until it has passed the root.

        Rebuilt at once, the heaps were a pause on the loop of 470-520 ms at 500k pending (filter and heapify of
        1M entries); a slice is O(_SWEEP log n), and a whole sweep, n / _SWEEP pushes, leaves no more than the
        stale entries added meanwhile (and the few a removal's sift carried past the cursor): bounded the same.
        Removed in place (the last entry put there and sifted), the heap stays a heap at every step, and the
        list a caller may hold is still the group's."""
        i = cursors.get(group)
        if i is None:
            i = len(heap) - 1
            self.compactions += 1
        i = min(i, len(heap) - 1)
        stop = max(i - self._SWEEP, -1)
        pending = self.pending      # the liveness of _scheduled (or the age heap's), inline: no call per entry
        removed = 0
        while i > stop:
            key, off = heap[i]
            tx = pending.get(off)
            if tx is None or tx.group != group or (sched and tx.next_check != key):
                last = heap.pop()
                if i < len(heap):
                    heap[i] = last
                    if last < (key, off):
                        heapq._siftdown(heap, 0, i)     # up, toward the root
                    else:
                        heapq._siftup(heap, i)          # down, to the leaves
                removed += 1
            i -= 1
        if i < 0:
            cursors.pop(group, None)
        else:
            cursors[group] = i
        return removed

    def _scheduled(self, group: str, when: int, off: int) -> bool:
        """The schedule entry (``when``, ``off``) of ``group`` is live: its transaction's next check, pending."""
        tx = self.pending.get(off)
        return tx is not None and tx.next_check == when and tx.group == group

    def _turn_push(self, when: int, group: str) -> None:
        """``group``, in the turn, has a check due at ``when``: on _turn_next (rebuilt from the groups in the turn
        when the entries of groups since served outnumber them)."""
        if len(self._turn_next) > 2 * len(self._turning) + self._NEXT_SLACK:
            sched = self._sched
            self._turn_next = [(sched[g][0][0], g) for g in self._turning if sched.get(g)]
            heapq.heapify(self._turn_next)
        heapq.heappush(self._turn_next, (when, group))

    def _top(self, group: str) -> int | None:
        """When ``group``'s next check is due (its schedule's stale entries dropped), None when it has none."""
        heap = self._sched.get(group)
        if heap is None:
            return None
        while heap:
            when, off = heap[0]
            if self._scheduled(group, when, off):
                return when
            heapq.heappop(heap)
        del self._sched[group]
        self._sched_sweep.pop(group, None)
        return None

    def _enter(self, group: str, now: int) -> None:
        """``group`` (not in turn) joins the turn if its next check is due at ``now``, else waits on _next."""
        top = self._top(group)
        if top is None:
            return
        if top <= now:
            self._turn.append(group)
            self._turning.add(group)
            self._turn_push(top, group)
        else:
            heapq.heappush(self._next, (top, group))

    def next_due(self) -> int | None:
        best = self._waking[0][0] if self._waking else None
        heap, turning = self._turn_next, self._turning
        while heap:                             # the groups found due: O(log) a call, however many they are
            when, group = heap[0]
            top = self._top(group) if group in turning else None
            if top is None:
                heapq.heappop(heap)
            elif top > when:
                heapq.heapreplace(heap, (top, group))
            else:
                best = when if best is None else min(when, best)
                break
        heap = self._next
        while heap:
            when, group = heap[0]
            top = None if group in turning else self._top(group)
            if top is None:
                heapq.heappop(heap)
            elif top > when:
                heapq.heapreplace(heap, (top, group))
            else:
                return when if best is None else min(when, best)
        return best

    # ------------------------------------------------------------ decisions
    def end(self, half_offset: int, op: str, *, origin: Origin, group: str | None = None,
            queue_offset: int | None = None, reason: str | None = None, channel=None) -> Reply | Write | Wait:
        """A decision (or UNKNOWN) for the transaction at ``half_offset``, from ``origin``; a check's answer with
        the ``channel`` it came on (else taken as from the one its check last went to)."""
        tx = self.pending.get(half_offset)
        if origin is Origin.CHECK and channel is not None and group is not None:
            # The producer that answers is no longer silent, whichever check it answers: a slow one answers a check
            # after it came due again and went to another producer (or was decided). Clearing the check's current
            # channel instead left the slow one passed over for good, and cleared one that had not answered.
            self._answered(channel, group)
        if tx is not None and origin in (Origin.PRODUCER, Origin.CHECK):
            refused = _not_its_half(tx.group, tx.queue_offset, group, queue_offset)
            if refused is not None:
                return refused
            if origin is Origin.CHECK:
                tx.awaiting = False
                tx.unanswered = 0
                if channel is None:
                    self._answered(tx.check_channel, tx.group)
                self._release(tx)
            tx.last_answer = op
        if op not in DECISIONS and op != UNKNOWN:
            return Reply(ResponseCode.SYSTEM_ERROR, f"{op} is not a decision", "refused")
        if tx is None:
            earlier = self.decided(half_offset)
            if earlier is None:
                return Reply(ResponseCode.SYSTEM_ERROR, NO_HALF, "no-half")
            # A decided half is held to the same checks as an undecided one (RocketMQ's checkPrepareMessage reads
            # the half whatever became of it): another group's END was answered as if it were the producer's.
            half = self.half_of(half_offset) if self.half_of is not None else None
            if half is not None and origin in (Origin.PRODUCER, Origin.CHECK):
                refused = _not_its_half(*half, group, queue_offset)
                if refused is not None:
                    return refused
            if op == UNKNOWN:       # no check will come: say what became of it instead of "will check back"
                if earlier == DEAD:
                    return Reply(ResponseCode.TRANSACTION_FAILED, "transaction already DEAD (dead-lettered): it is "
                                 "not checked back; UNKNOWN changes nothing", "unknown")
                return Reply(ResponseCode.SUCCESS, f"already {earlier}; UNKNOWN changes nothing", "unknown")
            if earlier == op:
                return Reply(ResponseCode.SUCCESS, f"already {op}; nothing changed", "duplicate")
            if earlier == DEAD and op == COMMIT and origin in (Origin.PRODUCER, Origin.CHECK):
                # Its producer committed its local transaction after the broker gave up checking (or expired the
                # half): its message waits on the dead-letter topic, which only an operator's resume delivers.
                # RocketMQ 4.9.8 delivers such a late COMMIT. (An admin's resolve is a conflict: its remark says.)
                return Reply(ResponseCode.TRANSACTION_FAILED,
                             f"transaction already DEAD (dead-lettered); COMMIT refused: its message is on the "
                             f"dead-letter topic, `admin resume {half_offset}` checks it again", "commit-after-dead")
            return Reply(ResponseCode.TRANSACTION_FAILED,
                         f"transaction already {earlier}; {op} refused (the first decision wins)", "conflict")
        if op == UNKNOWN:
            return Reply(ResponseCode.SUCCESS, "UNKNOWN recorded; the broker will check back", "unknown")
        if tx.deciding is not None:
            return Wait(tx)
        tx.deciding = op
        return Write(tx, op, reason)

    def written(self, tx: Tx, ok: bool) -> None:
        """The records of ``tx.deciding`` are durable (ok) or were refused (it stays pending, scheduled)."""
        if ok:
            self.withdraw(tx.half_offset)
            self._release(tx)
            self._undefer(tx)
            tx.parked = False
        tx.deciding = None

    def resume(self, tx: Tx, now: int, stored_at: int | None = None) -> str | None:
        """Re-open a dead-lettered transaction; None, or why not. ``stored_at``: as add's."""
        earlier = self.decided(tx.half_offset)
        if earlier != DEAD:
            # (undecided is not unknown: said "(unknown)", an operator resuming a half still being checked was told
            # the broker did not know it)
            state = (f"it is {earlier}" if earlier else "it is undecided: pending its checks"
                     if tx.half_offset in self.pending else "unknown")
            return f"transaction at {tx.half_offset} is not dead-lettered ({state})"
        if tx.half_offset in self.pending:
            return f"transaction at {tx.half_offset} is already pending again"
        tx.checks = 0
        tx.unanswered = 0
        tx.stored_at = tx.store_ts if stored_at is None else stored_at
        self._put(tx)
        self._reschedule(tx, now)
        self._age(tx)
        return None

    # --------------------------------------------------------------- checks
    def due(self, now: int, channel_for: Callable[[Tx], object],
            room_for: Callable[[str], int | None] | None = None, limit: int | None = None) -> tuple[list, list[Tx]]:
        """What is due at ``now``: (actions, deferred) with SendCheck and Write(DEAD) actions.

        ``deferred`` are due but have no producer connected: no check is spent, they come back after
        one interval, or as soon as a producer of their group joins (``producer_joined``). A transaction
        being decided stays scheduled (should the write fail).

        ``channel_for`` answers BUSY when the group's producers all have their cap of checks in flight:
        the transaction is parked, no check spent, until ``room_for(group)`` (asked first, each call that
        passes it) says its producers have room again: checks go as fast as they are answered, not all at
        once (a stock Java producer queues 2000 and drops the rest). ``room_for`` answers None when no
        producer of the group is here any more: its parked transactions all go back on the schedule, where
        they are deferred (counted, again after an interval) like any other due transaction nobody can be
        asked about. ``limit``: at most that many due entries are taken in this call (the caller yields to
        the event loop between calls).

        The groups with something due are served one transaction each in turn (oldest due first within a
        group), the turn carried over from one call to the next: another group's due check waits for one
        transaction of a backlog a turn, not the whole backlog."""
        policy, turn, turning = self.policy, self._turn, self._turning
        actions: list = []
        deferred: list[Tx] = []
        if room_for is not None:
            self._unpark(room_for, now)
        if self._waking:
            self._wake(now, limit)
        while self._next and self._next[0][0] <= now:      # (not held in a local: _push may rebuild it)
            group = heapq.heappop(self._next)[1]
            if group not in turning:
                self._enter(group, now)
        taken = 0
        # One transaction of each due group in turn: a group's backlog delays another group's due check by one
        # transaction of its own a turn, whatever its size (the turn goes on in the next call where this one ends).
        while turn:
            if limit is not None and taken >= limit:
                break
            group = turn.popleft()
            turning.discard(group)
            top = self._top(group)
            if top is None or top > now:
                if top is not None:
                    heapq.heappush(self._next, (top, group))
                continue
            off = heapq.heappop(self._sched[group])[1]
            tx = self.pending[off]
            self._enter(group, now)             # at the back of the turn, before tx may be rescheduled below
            taken += 1
            if tx.deferred:
                self._undefer(tx)
            if tx.deciding is not None:
                self._reschedule(tx, now + policy.check_interval_ms)
                continue
            if tx.awaiting:
                self._unanswered(tx.check_channel, tx.group)
            self._release(tx)           # due again: its last check was answered, or is taken as lost
            if tx.awaiting:
                tx.unanswered += 1
                tx.awaiting = False
            if tx.checks >= policy.check_max:
                tx.deciding = DEAD
                actions.append(Write(tx, DEAD, Origin.MAX_CHECKS.value))
                continue
            if not tx.group or not tx.topic:
                # No producer group to ask, or no topic to commit to (a record torn inside its properties by a
                # crash passes the store's checks, which cover the body): deferred for want of a producer of
                # group "", it waited for ever, seen only as "deferred". Dead-lettered now, saying why.
                tx.deciding = DEAD
                actions.append(Write(tx, DEAD, UNCHECKABLE))
                continue
            channel = channel_for(tx)
            if channel is None:
                deferred.append(tx)
                self._reschedule(tx, now + policy.check_interval_ms)
                tx.deferred = True
                self._deferred.setdefault(tx.group, {})[tx.half_offset] = tx
                continue
            if channel is BUSY:
                tx.parked = True
                self._parked.setdefault(tx.group, deque()).append(tx)
                continue
            tx.checks += 1
            tx.reasking, tx.reask = tx.reask, False
            tx.check_channel = channel
            self.checking.setdefault(channel, {})[tx.half_offset] = tx
            key = (channel, tx.group)
            self._held[key] = self._held.get(key, 0) + 1
            actions.append(SendCheck(tx, channel))
        self.taken += taken
        return actions, deferred

    def producer_joined(self, group: str, now: int) -> bool:
        """A producer of ``group`` is here now (its first heartbeat or half on a connection): the group's
        deferred transactions, rescheduled an interval on because nobody could be asked, are due at ``now``
        instead. They were due already (never before their immunity) and spent no check; check passes put
        them back on the schedule ``limit`` a slice (see due) and check them as the producers have room, as
        any due transaction. Its parked ones are left parked: the next pass gives them the room the new
        producer brings. True when a pass should run now (something is due, or the group has parked ones).

        O(1): the group's deferred are indexed (no scan of every pending transaction) and moved whole."""
        entries = self._deferred.pop(group, None)
        if entries:
            self._waking.append((now, entries))
        self.room_changed(group)
        return bool(entries) or bool(self._parked.get(group))

    def _wake(self, now: int, limit: int | None) -> None:
        """Due at ``now``: up to ``limit`` of the deferred transactions of groups a producer joined."""
        waking, pending = self._waking, self.pending
        budget = len(pending) if limit is None else limit
        while waking and budget > 0:
            entries = waking[0][1]
            while entries and budget > 0:
                off, tx = entries.popitem()
                if pending.get(off) is not tx or not tx.deferred:
                    continue                # decided, or came due meanwhile: not deferred any more
                if tx.deciding is not None:     # a decision is being written: deferred still, should it fail
                    self._deferred.setdefault(tx.group, {})[off] = tx
                    continue
                tx.deferred = False
                if tx.next_check > now:
                    self._reschedule(tx, now)
                budget -= 1
            if not entries:
                waking.popleft()

    def deferred_count(self) -> int:
        """Transactions deferred for want of a producer of their group, waking ones included (and stale entries
        of ones decided or due again meanwhile)."""
        return sum(len(d) for d in self._deferred.values()) + sum(len(d) for _, d in self._waking)

    def deferred_in(self, group: str) -> int:
        """Transactions of ``group`` deferred for want of a producer of it (stale entries included, as above)."""
        return len(self._deferred.get(group, ()))

    def _undefer(self, tx: Tx) -> None:
        tx.deferred = False
        entries = self._deferred.get(tx.group)
        if entries is not None and entries.pop(tx.half_offset, None) is not None and not entries:
            del self._deferred[tx.group]

    def parked(self) -> int:
        """Transactions due and waiting for a check slot (stale entries of decided ones included)."""
        return sum(len(q) for q in self._parked.values())

    def has_parked(self, group: str) -> bool:
        """Any transaction of ``group`` waiting for a check slot: O(1), for every check answer (a group's queue is
        dropped once empty, so a group listed has one)."""
        return group in self._parked

    def room_changed(self, group: str) -> None:
        """``group``'s producers may have room for more checks (a slot given back, a producer joined or gone): its
        parked transactions, if any, are offered it at the next pass."""
        if group in self._parked:
            self._roomy.add(group)

    def offer_all_due(self, now: int) -> bool:
        """Every group with parked transactions is to be offered room at ``now`` (_OFFER_ALL_MS since the last)."""
        return self._all_offered is None or now - self._all_offered >= self._OFFER_ALL_MS

    def _unpark(self, room_for: Callable[[str], int | None], now: int) -> None:
        """Back on the schedule, due at once: as many parked transactions of each group as it has room; all of
        them when no producer of the group is here (None): parked, they were never deferred, so nothing
        counted or alerted that nobody could answer for them, and their entries stayed for good.

        Asked of the groups whose room may have changed since they were last asked (_roomy), of all of them once
        each _OFFER_ALL_MS. A group given room and still parked is asked again at the next offer: the ones it
        put back may be decided before they take a slot, which nothing would say."""
        parked, pending = self._parked, self.pending
        if self.offer_all_due(now):
            self._all_offered = now
            groups = list(parked)
        else:
            groups = [g for g in self._roomy if g in parked]
        roomy = self._roomy = set()
        for group in groups:
            queue = parked[group]
            room = room_for(group)
            if room is None:
                room = len(queue)
            given = room > 0
            while queue and room > 0:
                tx = queue.popleft()
                if not tx.parked or pending.get(tx.half_offset) is not tx:
                    continue            # decided meanwhile
                tx.parked = False
                self._push(group, tx.next_check, tx.half_offset)
                room -= 1
            if not queue:
                del parked[group]
            elif given:
                roomy.add(group)

    def _release(self, tx: Tx) -> None:
        """``tx`` no longer holds a check slot of the channel its last check went to."""
        channel = tx.check_channel
        if channel is None:
            return
        tx.check_channel = None
        held = self.checking.get(channel)
        if held is not None and held.pop(tx.half_offset, None) is not None:
            self.released += 1
            self.room_changed(tx.group)
            if not held:
                del self.checking[channel]
            key = (channel, tx.group)
            left = self._held[key] - 1
            if left:
                self._held[key] = left
            else:
                del self._held[key]

    def _unanswered(self, channel, group: str) -> None:
        if channel is not None:
            groups = self.silent.setdefault(channel, {})
            groups[group] = groups.get(group, 0) + 1
            if groups[group] == 1:
                self.newly_silent.append((channel, group))

    def _answered(self, channel, group: str) -> None:
        groups = self.silent.get(channel)
        if groups is not None and groups.pop(group, None) is not None and not groups:
            del self.silent[channel]

    def unanswered_checks(self, channel, group: str) -> int:
        """Checks of ``group`` that ``channel`` left unanswered (came due again) since it last answered one."""
        groups = self.silent.get(channel)
        return 0 if groups is None else groups.get(group, 0)

    def in_flight(self, channel, group: str | None = None) -> int:
        """Checks ``channel`` holds: sent (or being sent) and not answered yet; with ``group``, of that producer
        group's transactions only. The cap is a channel's per group: a Java process shares one connection between
        its producers and queues each one's checks apart (checkRequestHoldMax), and one group whose listener hung
        held the connection's every slot, the other groups' transactions there waiting for one for ever."""
        if group is not None:
            return self._held.get((channel, group), 0)
        held = self.checking.get(channel)
        return 0 if held is None else len(held)

    def channel_closed(self, channel, now: int) -> list[Tx]:
        """The connection ``channel`` closed: the checks sent on it will never be answered. Each of those
        transactions is due at ``now`` instead of an interval on: the next pass counts that check unanswered
        and asks a live producer (or defers it, nobody being here). The lost check stays counted against
        ``check_max``, as RocketMQ counts every check it sends. Returns those transactions.

        A check still being written (chosen, not sent yet) only gives its slot back: its send fails on the
        closed channel and check_not_sent puts it due at once."""
        return self._lose(channel, now, None)

    def producer_left(self, channel, groups: str | frozenset, now: int) -> list[Tx]:
        """``channel`` unregistered its producer of ``groups`` (UNREGISTER_CLIENT: one; a set of them: dropped
        from them all for silence at one expiry, ClientRegistry.expire) and stays open: the checks of the groups'
        transactions sent on it will never be answered (a Java client drops a check for a group it has no
        producer of). As channel_closed, for those groups' alone: they waited for an interval to be taken as
        lost, while another producer of the group could have been asked at once. Returns those transactions.
        One walk for all the groups: a walk a group, 10,000 groups dropped at once with a check each in flight
        held the loop for 10^8 steps."""
        return self._lose(channel, now, frozenset((groups,)) if isinstance(groups, str) else groups)

    def _lose(self, channel, now: int, groups: frozenset | None) -> list[Tx]:
        """The checks ``channel`` holds (of ``groups``' transactions, or all) are lost: their slots given back,
        the sent ones due at ``now`` (_lost). Returns those."""
        if groups is None:
            self.silent.pop(channel, None)
        else:
            for group in groups:
                self._answered(channel, group)
        held = self.checking.get(channel)
        lost = []
        for off, tx in list((held or {}).items()):
            if groups is not None and tx.group not in groups:
                continue
            del held[off]
            tx.check_channel = None
            self._held.pop((channel, tx.group), None)
            self.room_changed(tx.group)
            if tx.awaiting and self._lost(tx, now):
                lost.append(tx)
        if held is not None and not held:
            del self.checking[channel]
        return lost

    def _lost(self, tx: Tx, now: int) -> bool:
        """``tx``'s check was lost with its connection: due at ``now`` (True), unless that check was itself such
        a re-ask, which waits the schedule its check record gave it: a producer that connects and closes in a
        loop would otherwise have every check of its transactions spent, and them dead-lettered, in a moment."""
        if self.pending.get(tx.half_offset) is not tx or tx.deciding is not None or tx.reasking:
            return False
        self._reschedule(tx, now)
        tx.reask = True
        # Not the last check a restart waits an interval after (the snapshot's "checked"): asked of nobody who
        # answers, it is due at once, and held a whole interval by a clean restart otherwise. (A kill -9 still
        # finds its check record's time: the record cannot say the check was lost.)
        tx.checked_at = 0
        return True

    def check_written(self, tx: Tx, now: int, ok: bool) -> bool:
        """The check record of ``tx`` is durable (send the check: True) or refused (False)."""
        if tx.half_offset not in self.pending:
            return False
        self._reschedule(tx, next_check_after_check(self.policy, now, tx.unanswered))
        if not ok:
            tx.checks -= 1
            self._release(tx)
            return False
        return True

    def check_sent(self, tx: Tx) -> None:
        tx.awaiting = True

    def check_not_sent(self, tx: Tx, now: int | None = None) -> bool:
        """The check record was written but the check could not be sent: the slot is free. ``now`` when its
        channel closed: due again at once, for another producer (True; the attempt stays counted, its record is
        written), as a check lost with its connection (_lost). Without it, an interval on: a check that fails to
        go out for another reason must not be re-sent in a loop that spends every check in a moment."""
        self._release(tx)
        return now is not None and self._lost(tx, now)

    def dead_letter_failed(self, tx: Tx, now: int) -> None:
        """A max-checks dead letter was refused by the store: try again after an interval."""
        if tx.half_offset in self.pending:
            self._reschedule(tx, now + self.policy.check_interval_ms)


def _not_its_half(half_group: str, half_queue_offset: int, group: str | None,
                  queue_offset: int | None) -> Reply | None:
    """RocketMQ's refusal of an END naming a half that is not the sender's (EndTransactionProcessor), or None."""
    if group is not None and half_group != group:
        return Reply(ResponseCode.SYSTEM_ERROR, "The producer group wrong", "not-its-half")
    if queue_offset is not None and half_queue_offset != queue_offset:
        return Reply(ResponseCode.SYSTEM_ERROR, "The transaction state table offset wrong", "not-its-half")
    return None


__all__ = ["TransactionCore", "Tx", "BUSY", "tx_from_half", "asks_delay", "Origin", "Reply", "Write", "Wait", "SendCheck",
           "UNKNOWN", "UNCHECKABLE", "DECISIONS", "COMMIT", "ROLLBACK", "DEAD", "RESUME"]
