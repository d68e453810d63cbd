"""BrokerConfig: every broker setting in one frozen dataclass.

Each field documents its default and why. The command line (``--store-dir``)
and the environment (``BROKER_STORE_DIR``) are generated from these fields by
broker/cli.py, so a new setting is one line here.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from protocol.errors import ConfigError

from .schedule.levels import parse_delay_levels


def setting(default, doc: str, *, choices: tuple | None = None):
    return field(default=default, metadata={"doc": doc, "choices": choices})


@dataclass(frozen=True)
class BrokerConfig:
    # ---- network
    host: str = setting("127.0.0.1", "Address the three listeners bind to. Loopback by default: a fresh broker is not exposed.")
    port: int = setting(10911, "Broker port (RocketMQ's default). 0 picks a free port.")
    vip_channel: bool = setting(True, "Serve the broker port on port - 2 as well (RocketMQ's fastListenPort, the VIP channel): Java clients before 4.5.1 send there by default (sendMessageWithVIPChannel) and failed with a refused connection. None with port 0 (no port - 2 to be had), when port - 2 is taken or is this master's --ha-port (said at WARNING).")
    namesrv_port: int = setting(9876, "Name-server port (RocketMQ's default). 0 picks a free port.")
    metrics_port: int = setting(5557, "Prometheus /metrics HTTP port. 0 picks a free port; -1 disables it.")
    advertised_host: str = setting("", "Address clients are told to use (routes, message ids). Empty: the bind host, or 127.0.0.1 when binding all interfaces.")
    # ---- identity
    broker_name: str = setting("broker-a", "Broker name in routes.")
    cluster_name: str = setting("DefaultCluster", "Cluster name in routes and the CLUSTER property (RocketMQ's default).")
    region_id: str = setting("DefaultRegion", "MSG_REGION in send responses; the Java client reads it unconditionally.")
    # ---- store
    store_dir: str = setting("./txmq-store", "Store directory, created when missing.")
    flush: str = setting("sync", "sync: acknowledge a send after it is on disk (group commit); async: flush every flush_interval_ms.", choices=("sync", "async"))
    flush_interval_ms: int = setting(500, "Async flush period.")
    gil_switch_interval_ms: float = setting(0.2, "Python's thread switch interval (sys.setswitchinterval, 5 ms by default): how long the flush and index threads may wait for a busy event loop to hand them the interpreter. Each group commit passes through a flush thread twice, so 5 ms stretched flushes of 0.2 ms to several ms under load.")
    segment_size: int = setting(1 << 30, "Commit-log segment size in bytes (RocketMQ's 1 GiB).")
    cq_units_per_file: int = setting(300_000, "Consume-queue units (20 bytes each) per file (RocketMQ's mappedFileSizeConsumeQueue, 300000). Fixed for a store: a store written with another value does not start.")
    max_message_size: int = setting(4 * 1024 * 1024, "Largest message body accepted (RocketMQ's 4 MiB); larger gets MESSAGE_ILLEGAL.")
    max_batch_messages: int = setting(0, "Messages one SEND_BATCH_MESSAGE may hold (RocketMQ has no such cap, only max_message_size for the whole body); more gets MESSAGE_ILLEGAL, nothing stored, counted in txmq_requests_refused_total{reason=\"batch-messages\"}. A batch is stored as one unit on the event loop, so its count is how long every other client waits: 150,000 one-byte messages (3.5 MB, no properties) held it 3.6 s. 0 (the default): max_message_size / 64 (65,536 at 4 MiB), more than a stock producer's batch of that size can hold (its smallest entry, a one-byte body naming WAIT and UNIQ_KEY, is 75 bytes: about 55,900), so no stock client meets it; 55,900 tiny ones hold the loop some 0.8 s on a loaded 2-core host (another client's SEND waited up to 2 s), 4,096 of them 70 ms. Set it lower to bound the hold, and split batches by count as well as by size.")
    disk_refuse_ratio: float = setting(0.90, "Refuse writes (SERVICE_NOT_AVAILABLE, 'disk is full') while the store's file system is at least this full; they resume by themselves below it less 0.01 (RocketMQ's diskSpaceWarningLevelRatio).")
    verify_all_reads: bool = setting(False, "Check the body CRC of every record a pull serves, and that its topic and properties (which no CRC covers) hold no NUL. Off: only of the records start-up did not verify (segments older than the ones recovery scans), where damage at rest is otherwise unseen; about 1.4 us a 1 KiB message when on. A record that fails is never served: the pull stops at it with an error (counted in txmq_store_corrupt_records_total, logged with segment and byte).")
    keep_corrupt_records: bool = setting(False, "Start even when a record mid-way through the log is damaged, if where it ends is sure (its head sound, an intact record right after it): only it is lost (logged at ERROR with topic, queue and offset; a pull stops at it until the group is moved past it with admin reset-offset), every intact record after it is kept and served. Remembered in the store (file corrupt_kept): later starts keep it again. Off: refuse to start and say where.")
    truncate_corrupt_tail: bool = setting(False, "Start even when the log is corrupt mid-way or ends short of what its checkpoint says was flushed, truncating from the damage (the data after it is lost). Off: refuse to start and say where.")
    # ---- limits
    max_frame_size: int = setting(16 * 1024 * 1024, "Largest frame accepted (RocketMQ's 16 MiB); larger closes the connection.")
    max_connections: int = setting(10000, "Connections accepted at once per listener (broker, name server, HA); more are closed on accept. Held lower, all listeners together, when the open-files limit leaves fewer beside --max-queues' files (a lower --max-queues or a higher ulimit -n leaves more), each listener keeping a share of its own; said at start (docs/operations.md).")
    max_connections_per_host: int = setting(2000, "Connections accepted at once per listener from one remote address; more are closed on accept (counted in txmq_requests_refused_total{reason=\"max_connections_per_host\"}, logged at most every 10 s). Without it one client opening idle connections up to max_connections locked every other client out.")
    max_in_flight: int = setting(256, "Requests one connection may have in progress; past it the broker stops reading that connection. Pulls parked by long polling do not count, up to four times this many.")
    max_write_buffer: int = setting(64 * 1024 * 1024, "Unread response bytes after which a connection that does not read is closed.")
    max_total_read_buffer: int = setting(256 * 1024 * 1024, "Bytes of request frames received but not yet whole that all connections may hold together. Past it, the connections whose frame has been unfinished longest are closed first (a sender at full speed finishes its frame in milliseconds; largest first, idle holders of 1 MiB each got a 4 MiB request in progress closed instead), until the total is back under it, each logged and counted in txmq_requests_refused_total{reason=\"max_total_read_buffer\"}: a frame may declare up to max_frame_size and arrive as slowly as its sender likes, and without it forty connections each holding 15 MiB of a frame never finished kept 600 MB (max_connections_per_host lets one address open thousands). A client that sends whole frames holds little for long.")
    max_total_write_buffer: int = setting(256 * 1024 * 1024, "Unread response bytes all connections may hold together. Past it, the connections holding the most (those that stopped reading first) are closed, largest first, until the total is back under it, each logged and counted in txmq_unread_closes_total{reason=\"max_total_write_buffer\"}: without it, a hundred clients that send but never read could hold max_write_buffer each, and the broker would be killed for its memory.")
    max_topics: int = setting(2048, "Topics the broker holds at most (system topics included); past it a new topic is refused with NO_PERMISSION naming this limit. Each topic costs memory, files and a catalogue entry; raise it for a larger catalogue.")
    max_topics_per_host: int = setting(512, "Topics the connections from one remote address (an IPv6 one by its /64) may have created and not deleted: auto-created by sends (%RETRY% and %DLQ% topics of send-backs too), the %RETRY% topics of its consumer groups' heartbeats and, without an ACL, by UPDATE_AND_CREATE_TOPIC. Past it a new topic is refused with NO_PERMISSION naming this limit (counted in txmq_requests_refused_total{reason=\"topic-host-limit\"}, logged at most every 10 s); a topic of its deleted gives the room back, and at the limit its empty %RETRY% topics of groups with no consumer are forgotten first (as at max_retry_groups). Saved with each topic in the catalogue, so the count holds across restarts (a catalogue of an older version charges its topics to no one); not counted on a slave. Without it one client could fill max_topics, and every other client's new topic was refused until an operator deleted topics.")
    max_queues: int = setting(0, "Consume queues all topics together may have (each topic's read or write queue count, the larger, or the most it had since it was made: a topic made smaller keeps its queues until deleted; system topics count too). Past it a topic is not created, nor given more queues, by a send or UPDATE_AND_CREATE_TOPIC: NO_PERMISSION naming this limit, counted in txmq_requests_refused_total{reason=\"queue-limit\"}, logged at most every 10 s; topics there are (a store holding more than this, from before the limit) are served as ever. Each queue written holds a consume-queue file mapped with two file descriptors (measured: 2 descriptors, 1 mapping, about 6 KB of memory and 68 KB of disk). 0 (the default): what the process's limits hold, read at start after the open-files limit is raised to its hard limit: (open files - headroom) / 2 and vm.max_map_count - headroom, the smaller (headroom: 4096, or a quarter of a limit under 16384, for segments, connections, libraries), at most 2048 x 1024 (what it is when no limit is known), so the default never refuses a queue the machine could open and never warns. Set, it is kept, and the broker warns at start when the limits cannot hold it. Without it a topic may have 1024 queues, and 2048 topics could ask for two million files.")
    max_queues_per_host: int = setting(8192, "Consume queues the topics one remote address (an IPv6 one by its /64) made may have (counted as for max_queues; a topic given more queues by UPDATE_AND_CREATE_TOPIC counts, all its queues, for the address that asked). Past it a new topic, or more queues, is refused NO_PERMISSION naming this limit, counted in txmq_requests_refused_total{reason=\"queue-host-limit\"}, logged at most every 10 s; deleting a topic gives its queues back. 8192 is max_topics_per_host topics of 16 queues: without it one client's topics of 1024 queues each could take every file the broker may open.")
    ipv6_client_prefix: int = setting(64, "IPv6 clients are counted by this prefix of their address for every per-host limit (connections, groups, parked pulls, queue locks, topics, offsets): 64, a /64, is what one IPv6 host or site is given, and a client picking a source address per connection from it got round every per-host limit when counted by address. But a data-centre or cloud subnet (an AWS VPC subnet, its EKS pods) is one /64 holding many hosts, which then share one host's room: 128 counts each address as itself. ::1, link-local and IPv4-mapped addresses are counted as themselves whatever this is.")
    max_offsets_per_host: int = setting(100000, "Committed consumer offsets (one a group, topic and queue) the connections from one remote address (an IPv6 one by its /64) may have made, by UPDATE_CONSUMER_OFFSET or a pull's commitOffset; an offset it made is moved as ever. Past it a new one is refused naming this limit (a pull is still answered, its commit not kept), counted in txmq_requests_refused_total{reason=\"offset-host-limit\"} and logged at most every 10 s; deleting the group with its offsets (deleteSubGroup, removeOffset) or its topic gives the room back. Saved with the offsets, so the count holds across restarts; not counted on a slave. Group names cost nothing, and without it one client looping over made-up names grew the offsets table, its file rewritten every few seconds and every slave's copy without end.")
    max_offsets: int = setting(500000, "Committed consumer offsets (one a group, topic and queue) the broker holds at most, all clients together: past it a new one is refused naming this limit (a pull is still answered, its commit not kept; a forced reset leaves a queue the group has no offset for as it is; an offset there is is moved as ever), counted in txmq_requests_refused_total{reason=\"offset-limit\"} and logged at most every 10 s. max_offsets_per_host bounds one address, but addresses are many (a NAT's clients, a host's IPv4 aliases, 127.0.0.0/8): without this, clients from enough addresses grew the table, its saves and every slave's copy without bound. RocketMQ has no such limit; 5 times a large deployment's 100,000 (each 100,000 take some 170 MB of the broker's memory at a save and 6.6 MB of file, rewritten at each save). Not counted on a slave (its offsets are its master's copies).")
    max_auto_create_topics_per_s: float = setting(10.0, "Topics one client (remote address) may auto-create per second (a token bucket, burst the same); past it the send gets SYSTEM_BUSY. Stops one client flooding the catalogue.")
    max_writer_queued_bytes: int = setting(64 * 1024 * 1024, "Send bytes waiting for the store writer; past it sends get SYSTEM_BUSY with RocketMQ's [TIMEOUT_CLEAN_QUEUE] remark, so stock clients back off instead of growing the queue.")
    max_undecided_per_group: int = setting(100000, "Undecided transactions one producer group may hold; past it new half messages get SYSTEM_BUSY. Bounds the pending index one group can grow.")
    max_undecided: int = setting(1000000, "Undecided transactions the broker holds at most, every producer group together; past it new half messages of any group get SYSTEM_BUSY naming this limit, counted in txmq_requests_refused_total{reason=\"undecided-total-limit\"} and logged at most every 10 s with the groups holding the most (alert TxmqUndecidedLimitReached). Each undecided transaction is kept in memory (about 1 KB of the broker's RSS, measured): max_undecided_per_group bounds one group, but groups are many (a connection may join 10,000), and 30 groups of 100,000 held 3 GB. RocketMQ has no such limit (its half queue is read from disk); raise it with the memory to hold it.")
    max_subscription_groups: int = setting(50000, "Subscription groups (UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, mqadmin updateSubGroup) the broker stores at most. Past it a new group is refused NO_PERMISSION naming this limit, nothing stored (a group stored already is updated as ever; DELETE_SUBSCRIPTIONGROUP gives the room back), counted in txmq_requests_refused_total{reason=\"subscription-group-limit\"}, logged at most every 10 s. RocketMQ has no such cap, but every update rewrites the whole subscriptionGroup.json: a client looping made-up group names grew the file and the broker's memory without bound, each update slower than the last (430 bytes a group; 270 ms an update at 6,400 groups). A slave's copy of its master's groups is not capped.")
    max_retry_groups: int = setting(1024, "%RETRY% topics (consumer groups that may retry) the broker creates at most. At it, the empty retry topics of groups with no consumer connected and no config of their own are forgotten (at most one sweep a second; a group makes its topic again with its next heartbeat); if none is, a new group's retry topic is refused.")
    # ---- security
    acl_file: str = setting("", "RocketMQ plain_acl.yml: requests must be signed by an account (AclClientRPCHook) and permitted; reloaded when it changes. Empty: no access control (say so loudly when bound beyond loopback).")
    # ---- topics and consumers
    auto_create_topic: bool = setting(True, "Create unknown topics on first send from TBW102 (RocketMQ's default).")
    trace_topic_enable: bool = setting(False, "Create RMQ_SYS_TRACE_TOPIC (1 queue) at start when missing, as RocketMQ's traceTopicEnable (off by default there too): clients with message tracing send their traces to it, and it is a system topic, so with auto_create_topic off nothing else can create it (updateTopic refuses system topics). A client's customized trace topic is an ordinary topic: create it with updateTopic.")
    default_topic_queue_nums: int = setting(8, "Queues of TBW102, the auto-create template (RocketMQ's default).")
    enable_property_filter: bool = setting(False, "Filter messages for consumers that subscribe with SQL92 (MessageSelector.bySql; RocketMQ's enablePropertyFilter, off there too). Off: CHECK_CLIENT_CONFIG and PULL refuse SQL92 with SYSTEM_ERROR, as a stock broker does, so a client fails at start rather than consuming unfiltered. Off by default because each SQL92 pull reads and evaluates the properties of every message it scans, on the event loop (README, 'SQL92 filtering'): turn it on for the consumers that need it.")
    long_polling: bool = setting(True, "Hold pulls that find nothing until a message arrives or the client's suspend time ends.")
    short_polling_ms: int = setting(1000, "Hold time when long polling is off.")
    max_suspend_ms: int = setting(25000, "Longest a pull is held, whatever the client asks: clients time out at 30 s.")
    flush_consumer_offset_interval_ms: int = setting(5000, "How often committed consumer offsets, when changed, are written to config/consumerOffset.json (RocketMQ's flushConsumerOffsetInterval). A kill -9 loses the last interval's commits; consumers commit their position again every round, changed or not, so that costs redeliveries only to a consumer that takes a queue over meanwhile.")
    channel_expire_ms: int = setting(120000, "A client not heard from for this long is dropped from its groups (RocketMQ's 120 s), and a connection that sent nothing, or whose peer read none of its responses, or whose request frame stayed unfinished (a byte now and then), for this long is closed (RocketMQ's serverChannelMaxIdleTimeSeconds, 120 s; stock clients heartbeat every 30 s): its peer went away without closing it, and it held its address's room (max_connections_per_host).")
    access_message_in_memory_max_ratio: int = setting(40, "RocketMQ's accessMessageInMemoryMaxRatio, percent of physical RAM: a message further than this from the log's end counts as on disk. A group with no offset for a queue is told 0 (start at its first message) only while that message is not on disk; else QUERY_NOT_FOUND, and the client starts where its consumeFromWhere says (the end, or its timestamp). Also the distance past which slave_read_enable suggests the slave.")
    max_reconsume_times: int = setting(16, "Retries before a failed message goes to %DLQ%<group> (RocketMQ's 16).")
    message_delay_level: str = setting("1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h", "Delay of each DELAY level, level 1 first (RocketMQ's messageDelayLevel; units ms, s, m, h, d). A failed message's n-th retry waits level 3 + n.")
    timer_max_delay_s: int = setting(3 * 24 * 3600, "Latest a timer message (TIMER_DELIVER_MS / TIMER_DELAY_SEC / TIMER_DELAY_MS, Aliyun's __STARTDELIVERTIME) may ask to be delivered, in seconds from now; later is refused MESSAGE_ILLEGAL (RocketMQ 5's timerMaxDelaySec, 3 days, within the log's 72 h retention; a shorter file_reserved_hours bounds it instead, as retention would remove a later one first).")
    queue_lock_max_live_ms: int = setting(60000, "An orderly consumer's queue lock (LOCK_BATCH_MQ) not renewed for this long may be taken by another consumer of the group: how long a crashed orderly consumer holds its queues (RocketMQ's rocketmq.broker.rebalance.lockMaxLiveTime, 60 s). Below 30000 a WARNING at start: a stock orderly consumer renews its locks every 20 s and trusts one for 30 s after its grant, so a lock lapsing sooner may be granted to another consumer while its holder still consumes the queue (two at once, out of order).")
    max_queue_locks: int = setting(200000, "Queue locks (LOCK_BATCH_MQ) held at once, all groups and clients together, about 350 bytes each (70 MB). A lock is kept queue_lock_max_live_ms after its last renewal and a group name costs nothing, so a client rotating group names could grow the table by gigabytes a minute. Past it a new lock is not granted (left out of lockOKMQSet, as a queue another consumer holds: a stock orderly consumer leaves the queue alone and asks again later) and a WARNING is logged; renewals of locks held are still granted.")
    max_parked_pulls_per_host: int = setting(20000, "Pulls held by long polling at once for the connections from one remote address (about 5.6 KB each: 110 MB). Past it a pull that finds nothing is answered SYSTEM_BUSY naming this limit at once (a stock push consumer pulls that queue again after 3 s), counted in txmq_requests_refused_total{reason=\"parked-pull-limit\"}. Each connection may hold max_in_flight * 4, so without it one client opening connections could hold gigabytes.")
    max_groups_per_host: int = setting(10000, "Producer and consumer group memberships (a connection in a group, from a heartbeat or a transactional send) the connections from one remote address may hold at once. Past it a heartbeat still renews the groups joined, joins no new one and is answered SYSTEM_BUSY naming this limit (counted in txmq_requests_refused_total{reason=\"group-limit\"}, logged at most every 10 s): group names cost a client nothing, and one heartbeating made-up names grew the broker by some 40 MB a second, without bound.")
    max_heartbeat_bytes: int = setting(4 * 1024 * 1024, "Largest HEART_BEAT body read, in bytes. A heartbeat body is parsed as one JSON document on the event loop, which no other client's request interrupts: 15 MB held every other client 0.6-2 s a heartbeat (the parse alone), against some 70 ms at 4 MiB. A stock client's heartbeat names each of its groups with its subscriptions, some 200 bytes a topic: 4 MiB is 20,000 subscriptions, far past any client we know of. Past it the body is not read: the groups its connection is in are renewed, none is joined or changed, and it is answered SYSTEM_BUSY naming this limit (txmq_requests_refused_total{reason=\"heartbeat-size\"}, logged at most every 10 s).")
    max_subscription_bytes_per_group: int = setting(256 * 1024, "Text a consumer group's subscriptions may hold (topics, expressions, tags), in bytes: what one heartbeat gives, with those kept for a newer subVersion than it names. A group past it is neither joined nor changed (a member stays one) and the heartbeat is answered SYSTEM_BUSY naming this limit (txmq_requests_refused_total{reason=\"subscription-limit\"}): each group keeps what its last heartbeat said, and without it that was up to a frame (16 MiB) a group.")
    max_subscription_bytes_per_host: int = setting(4 * 1024 * 1024, "Text the consumer groups' subscriptions may hold, in bytes as for max_subscription_bytes_per_group, all together for the groups whose subscriptions a heartbeat from one remote address (an IPv6 one by its /64) last set. Past it a group new to that address, or one it would give more, is neither joined nor changed (a member stays one) and the heartbeat is answered SYSTEM_BUSY naming this limit (txmq_requests_refused_total{reason=\"subscription-host-limit\"}, logged at most every 10 s); a group nobody is in any more gives its room back. A group's subscriptions are kept as up to some 40 times their text (256 KiB of 37,000 topics: 10 MB), and without it one address heartbeating groups at max_subscription_bytes_per_group, up to max_groups_per_host of them, could make the broker keep 80 GB. 4 MiB is some 80,000 subscriptions of 50 bytes, kept as up to some 160 MB (measured: 16 groups of 37,000 topics, 159 MiB; of 80,000 tags, 152 MiB).")
    max_queue_locks_per_host: int = setting(50000, "Queue locks the connections from one remote address may hold at once, open or closed (a closed connection's locks are kept until they expire). Past it a new lock is refused as past max_queue_locks, so a client opening connection after connection cannot take the whole table from clients on other hosts.")
    max_queue_locks_per_connection: int = setting(20000, "Queue locks one connection may hold at once (a Java client process shares one connection per broker between all its consumers: its orderly groups x the queues of this broker each is given). Past it a new lock is refused as past max_queue_locks, so one connection cannot take the whole table from every other client.")
    # ---- transactions
    transaction_check_interval_ms: int = setting(60000, "How often undecided transactions are checked (RocketMQ's transactionCheckInterval).")
    transaction_timeout_ms: int = setting(6000, "Immunity: age before the first check; CHECK_IMMUNITY_TIME_IN_SECONDS overrides it per message (never below 1 s, or this when lower).")
    transaction_check_in_flight_max: int = setting(2000, "Checks one producer connection may have unanswered at once for one producer group (a Java process shares its connection between its producers and queues each one's checks apart); past it (or while that producer is not reading what the broker sends) the group's due transactions wait, no check spent, until answers come back. A stock Java producer holds 2000 checks (checkRequestHoldMax) and drops the rest; sending 50000 at once after a restart would spend checks nobody could answer.")
    transaction_check_max: int = setting(15, "Checks before an undecided transaction goes to TRANS_CHECK_MAX_TIME_TOPIC.")
    transaction_retention_hours: float = setting(72.0, "Undecided half messages older than this are expired to the dead-letter topic.")
    transaction_snapshot_interval_s: float = setting(10.0, "How often (when something changed) the undecided-transaction index and the op-queue offset it covers are written to transactions/snapshot.json; start-up replays only the op records after it. Also written at a clean stop.")
    # ---- retention (broker/retention.py)
    file_reserved_hours: float = setting(72.0, "A sealed segment whose newest record is older than this may be removed, consumed or not (RocketMQ's fileReservedTime); consumers behind it get PULL_OFFSET_MOVED and go on from the new minimum.")
    retain_unconsumed_max_bytes: int = setting(0, "Opt-in: keep expired segments some consumer group has not consumed while the commit log is at most this many bytes. 0 (RocketMQ's behaviour): expired data goes, consumed or not.")
    plan_clock_skew_ms: int = setting(60000, "An expiry plan whose now_ms is ahead of the broker's clock by more than this is refused whole: it was made on a host with a wrong clock or for a time to come.")
    disk_clean_ratio: float = setting(0.75, "Above this share of the store's file system in use the broker removes expired segments at once, without waiting for the nightly plan (RocketMQ's diskMaxUsedSpaceRatio).")
    disk_force_clean_ratio: float = setting(0.85, "Above this it removes the oldest segments even if younger than the retention, never the active one; undecided halves in them are dead-lettered first (RocketMQ's diskSpaceCleanForciblyRatio).")
    disk_clean_interval_s: float = setting(5.0, "How often the disk usage is compared with the two ratios above.")
    # ---- message index (broker/store/index.py)
    message_index_enable: bool = setting(True, "Index every message by its KEYS and UNIQ_KEY for QUERY_MESSAGE and `admin query-key` (RocketMQ's messageIndexEnable).")
    index_hash_slots: int = setting(5_000_000, "Hash slots per index file (RocketMQ's maxHashSlotNum); files are sparse, but a file's slot table (4 bytes a slot) is allocated whole at its first entry, and only while the disk stays below disk_refuse_ratio and disk_force_clean_ratio with it and one more commit-log segment (segment_size); otherwise indexing stops (txmq_index_failed) until there is room.")
    index_max_entries: int = setting(20_000_000, "Entries per index file (RocketMQ's maxIndexNum); a full file is followed by a new one.")
    index_file_period_hours: float = setting(24.0, "A new index file starts when the last one holds entries this old, so retention can remove old files with their segments.")
    # ---- cluster: many brokers under stand-alone name servers (broker/registration.py)
    namesrv_addr: str = setting("", "Name servers to register with, HOST:PORT separated by ';' (RocketMQ's namesrvAddr). Set: the broker registers with each (REGISTER_BROKER every register_period_ms, UNREGISTER_BROKER at a clean stop) and runs no name server of its own. Empty: the embedded name server serves this broker alone.")
    broker_id: int = setting(0, "0: master; 1 and up: a slave of the master with the same broker_name (RocketMQ's brokerId).")
    register_period_ms: int = setting(30000, "How often the broker registers with its name servers (RocketMQ's registerNameServerPeriod); they drop a broker silent for broker_expire_ms (120 s). A topic created or deleted registers at once.")
    register_timeout_ms: int = setting(6000, "How long one registration may take per name server (RocketMQ's registerBrokerTimeoutMills).")
    register_compressed: bool = setting(False, "Send the registration body deflated (RocketMQ's compressedRegister); for very many topics.")
    # ---- replication (broker/ha; RocketMQ 4.x HA)
    broker_role: str = setting("ASYNC_MASTER", "RocketMQ's brokerRole. ASYNC_MASTER: acknowledge when stored here (a slave, if any, follows). SYNC_MASTER: acknowledge a send only when a slave has it too (else FLUSH_SLAVE_TIMEOUT or SLAVE_NOT_AVAILABLE, the message stored all the same). SLAVE: copy --ha-master-addr's commit log byte for byte, serve pulls, refuse sends.", choices=("ASYNC_MASTER", "SYNC_MASTER", "SLAVE"))
    ha_port: int = setting(-1, "Port a master listens on for its slaves (RocketMQ's haListenPort, there the broker port + 1). 0 picks a free port (printed as ha=HOST:PORT on the LISTENING line); -1: no HA listener (a SYNC_MASTER needs one).")
    ha_master_addr: str = setting("", "SLAVE: the master's HA address HOST:PORT to follow (RocketMQ's haMasterAddress).")
    ha_slave_timeout_ms: int = setting(3000, "SYNC_MASTER: how long a send waits for the slave to confirm it before FLUSH_SLAVE_TIMEOUT (RocketMQ 4.9.8's slaveTimeout).")
    ha_slave_fallbehind_max: int = setting(256 * 1024 * 1024, "SYNC_MASTER: a slave further behind than this many bytes counts as absent: sends get SLAVE_NOT_AVAILABLE at once (RocketMQ's haSlaveFallbehindMax).")
    ha_heartbeat_interval_ms: int = setting(5000, "A slave reports its offset at least this often, and a master with nothing to send sends an empty frame this often (RocketMQ's haSendHeartbeatInterval).")
    ha_housekeeping_interval_ms: int = setting(20000, "Either side drops an HA connection silent for this long; the slave reconnects (RocketMQ's haHousekeepingInterval).")
    ha_transfer_batch_size: int = setting(32 * 1024, "Bytes of commit log a master sends a slave per frame, at least one whole record (RocketMQ's haTransferBatchSize).")
    slave_sync_interval_ms: int = setting(10000, "SLAVE: how often it copies its master's committed consumer offsets (GET_ALL_CONSUMER_OFFSET, RocketMQ's SlaveSynchronize every 10 s), so consumers that fail over to it go on from there, its subscription groups (GET_ALL_SUBSCRIPTIONGROUP_CONFIG, replacing the slave's), so what updateSubGroup set on the master holds on the slave, and its topic configs (GET_ALL_TOPIC_CONFIG: queues, perm and order as the master's; a topic the master deleted is deleted on the slave). The master's broker address comes from the name server (--namesrv-addr); with an ACL on the master, whitelist the slave's address there.")
    slave_group_forget_ms: int = setting(30000, "SLAVE: how long its master's answers must go on missing a consumer group, from the first that missed it (the time between answers in a row: a master away does not count, nor is what came before lost, unless the master restarted: a new bootTimestamp starts it again), before the slave removes the group's copied offsets as the master did (DELETE_SUBSCRIPTIONGROUP with removeOffset); at least two answers in a row. A master killed -9 comes back without the commits of its last --flush-consumer-offset-interval-ms (5 s), a new group's first ones among them, until the group's consumers commit again (a Java consumer every 5 s once it reaches the master again): removed meanwhile, a consumer failing over to the slave started the group over. Keep it above the master's offset flush interval plus its consumers' commit interval.")
    slave_read_enable: bool = setting(False, "RocketMQ's slaveReadEnable: pull replies suggest the group's whichBrokerWhenConsumeSlowly (the slave, 1, by default) to a consumer far behind the log (more than access_message_in_memory_max_ratio of RAM), else the group's brokerId (the master, 0, by default). A slave serves pulls either way.")
    # ---- operations
    metrics_snapshot_interval_s: float = setting(60.0, "Period of the metric snapshots appended under <store>/metrics for the Spark rollups; 0 disables them.")
    metrics_snapshot_retention_days: int = setting(7, "Days of metric snapshot files (<store>/metrics/<UTC date>.jsonl) kept besides today's; older ones are removed once a day. The nightly rollup reads the day before and the day after its date. 0 keeps them all (archive them some other way: they share the store's disk, whose pressure cleaning removes only commit-log segments).")
    log_level: str = setting("INFO", "Logging level.", choices=("DEBUG", "INFO", "WARNING", "ERROR"))

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            choices = f.metadata.get("choices")
            if choices and value not in choices:
                raise ConfigError(f"{f.name}={value!r}: choose one of {', '.join(choices)}")
        for name in ("port", "namesrv_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ConfigError(f"{name}={getattr(self, name)} is not a port number")
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port={self.metrics_port} is not a port number (-1 disables metrics)")
        for name in ("segment_size", "cq_units_per_file", "max_message_size", "max_frame_size", "max_connections", "max_in_flight",
                     "max_connections_per_host",
                     "flush_interval_ms", "transaction_check_interval_ms", "transaction_check_max", "transaction_check_in_flight_max",
                     "default_topic_queue_nums", "max_topics", "max_topics_per_host", "max_offsets_per_host", "max_offsets", "max_queues_per_host", "max_writer_queued_bytes", "max_write_buffer",
                     "max_total_write_buffer", "max_total_read_buffer", "max_undecided_per_group", "max_undecided", "max_retry_groups", "max_subscription_groups",
                     "flush_consumer_offset_interval_ms", "channel_expire_ms", "max_queue_locks", "max_queue_locks_per_connection",
                     "max_queue_locks_per_host", "max_groups_per_host", "max_parked_pulls_per_host",
                     "max_subscription_bytes_per_group", "max_subscription_bytes_per_host",
                     # 0 or less: every lock lapsed the moment it was granted, and LOCK_BATCH_MQ gave each queue to
                     # every orderly consumer of the group that asked: all of them consumed it at once, out of order
                     "queue_lock_max_live_ms"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be positive")
        if self.max_batch_messages < 0:
            raise ConfigError(f"max_batch_messages={self.max_batch_messages} must not be negative "
                              "(0: max_message_size / 64)")
        if self.max_queues < 0:
            raise ConfigError(f"max_queues={self.max_queues} must not be negative (0: what the process's limits hold)")
        if not 1 <= self.ipv6_client_prefix <= 128:
            raise ConfigError(f"ipv6_client_prefix={self.ipv6_client_prefix} is not an IPv6 prefix length (1 to 128)")
        if not 0.0 < self.gil_switch_interval_ms <= 100:
            raise ConfigError(f"gil_switch_interval_ms={self.gil_switch_interval_ms} must be in (0, 100]")
        if not 0 <= self.access_message_in_memory_max_ratio <= 100:
            raise ConfigError(f"access_message_in_memory_max_ratio={self.access_message_in_memory_max_ratio} must be "
                              "a percentage, 0 to 100")
        if not 0.0 < self.disk_refuse_ratio <= 1.0:
            raise ConfigError(f"disk_refuse_ratio={self.disk_refuse_ratio} must be in (0, 1]")
        if self.metrics_snapshot_retention_days < 0:
            raise ConfigError(f"metrics_snapshot_retention_days={self.metrics_snapshot_retention_days} must not be "
                              "negative (0 keeps every file)")
        if self.max_auto_create_topics_per_s <= 0:
            raise ConfigError("max_auto_create_topics_per_s must be positive")
        if self.transaction_snapshot_interval_s <= 0:
            raise ConfigError(f"transaction_snapshot_interval_s={self.transaction_snapshot_interval_s} must be positive")
        if self.transaction_timeout_ms < 0:
            raise ConfigError("transaction_timeout_ms must not be negative")
        if not 0 < self.disk_clean_ratio <= self.disk_force_clean_ratio < 1:
            raise ConfigError(f"disk ratios must satisfy 0 < disk_clean_ratio ({self.disk_clean_ratio}) <= "
                              f"disk_force_clean_ratio ({self.disk_force_clean_ratio}) < 1")
        if self.file_reserved_hours <= 0 or self.disk_clean_interval_s <= 0:
            raise ConfigError("file_reserved_hours and disk_clean_interval_s must be positive")
        if self.retain_unconsumed_max_bytes < 0 or self.plan_clock_skew_ms < 0:
            raise ConfigError("retain_unconsumed_max_bytes and plan_clock_skew_ms must not be negative")
        try:
            parse_delay_levels(self.message_delay_level)
        except ValueError as exc:
            raise ConfigError(f"message_delay_level={self.message_delay_level!r}: {exc}") from None
        if self.timer_max_delay_s <= 0:
            raise ConfigError("timer_max_delay_s must be positive")
        if self.index_hash_slots <= 0 or self.index_max_entries < 2 or self.index_file_period_hours <= 0:
            raise ConfigError("index_hash_slots and index_file_period_hours must be positive, index_max_entries at least 2")
        self._check_replication()
        if self.max_message_size + 4096 > self.segment_size:
            raise ConfigError(f"segment_size={self.segment_size} cannot hold a max_message_size={self.max_message_size} record")

        self._check_cluster()

    def _check_cluster(self) -> None:
        self.namesrv_addrs          # parses, or raises ConfigError
        if self.broker_id < 0:
            raise ConfigError(f"broker_id={self.broker_id} must not be negative (0 master, 1+ slave)")
        if self.register_period_ms <= 0 or self.register_timeout_ms <= 0:
            raise ConfigError("register_period_ms and register_timeout_ms must be positive")

    @property
    def batch_messages_cap(self) -> int:
        """max_batch_messages, or when 0 what no stock producer's batch of max_message_size can reach."""
        return self.max_batch_messages or max(1, self.max_message_size // 64)

    @property
    def namesrv_addrs(self) -> list[str]:
        """``namesrv_addr`` split into HOST:PORT strings; [] runs the embedded name server."""
        return parse_namesrv_addr(self.namesrv_addr)

    def _check_replication(self) -> None:
        if not -1 <= self.ha_port <= 65535:
            raise ConfigError(f"ha_port={self.ha_port} is not a port number (-1: no HA listener)")
        if self.broker_role == "SYNC_MASTER" and self.ha_port < 0:
            raise ConfigError("broker_role=SYNC_MASTER needs --ha-port for its slave to connect to (0 picks one)")
        if self.broker_role == "SLAVE":
            if self.broker_id <= 0:
                raise ConfigError(f"broker_role=SLAVE needs --broker-id 1 or more, not {self.broker_id}: 0 is its "
                                  "master's id in the routes (RocketMQ refuses it too)")
            host, _, port = self.ha_master_addr.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"broker_role=SLAVE needs --ha-master-addr HOST:PORT, not {self.ha_master_addr!r}")
        else:
            if self.broker_id > 0:
                raise ConfigError(f"broker_id={self.broker_id} is a slave's id, but broker_role={self.broker_role}: "
                                  "name servers route a broker's topics only from its id 0 (RocketMQ sets a "
                                  "master's id to 0)")
            if self.ha_master_addr:
                raise ConfigError(f"ha_master_addr is for a SLAVE; this broker is {self.broker_role}")
        for name in ("ha_slave_timeout_ms", "ha_slave_fallbehind_max", "ha_heartbeat_interval_ms",
                     "ha_housekeeping_interval_ms", "ha_transfer_batch_size", "slave_sync_interval_ms",
                     "slave_group_forget_ms"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be positive")

    @property
    def public_host(self) -> str:
        return public_host(self.host, self.advertised_host)


def public_host(host: str, advertised: str) -> str:
    """The address clients are told: ``advertised``, else ``host`` (loopback for a wildcard bind)."""
    if advertised:
        return advertised
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def parse_namesrv_addr(text: str) -> list[str]:
    """'h1:p1;h2:p2' -> ['h1:p1', 'h2:p2'], each checked; ConfigError names a bad one."""
    addrs = []
    for part in text.split(";"):
        part = part.strip()
        if not part:
            continue
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ConfigError(f"namesrv_addr: {part!r} is not HOST:PORT")
        addrs.append(part)
    return addrs
