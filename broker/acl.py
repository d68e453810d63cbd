"""RocketMQ 4.x plain ACL: plain_acl.yml accounts and the request signature check.

The file is RocketMQ's (distribution/conf/plain_acl.yml)::

    globalWhiteRemoteAddresses: ["10.10.103.*"]   # these hosts need no credentials at all
    accounts:
      - accessKey: RocketMQ
        secretKey: "12345678"
        whiteRemoteAddress: ""                  # this account from these hosts: no signature needed
        admin: false                            # admin codes (topic create/delete, txmq admin) need true
        defaultTopicPerm: DENY                  # DENY | PUB | SUB | PUB|SUB
        defaultGroupPerm: SUB
        topicPerms: ["topicA=DENY", "topicB=PUB|SUB"]
        groupPerms: ["groupA=DENY"]

``check`` follows PlainPermissionManager.validate step by step (global white list, access key
known, account white list, HmacSHA1 signature over the sorted extFields and the body, admin
codes, then each resource the request touches as PlainAccessValidator.parse finds them) and
answers the AclException text RocketMQ would, which the server sends as NO_PERMISSION (16).
Groups are resources named by their retry topic, as in RocketMQ.
"""
from __future__ import annotations

import hmac
import json
import logging
import os
from dataclasses import dataclass, field

import yaml

from protocol.codes import RequestCode as R
from protocol.errors import ConfigError
from protocol.signature import ACCESS_KEY, SIGNATURE, signature, signed_content

log = logging.getLogger("txmq.acl")

DENY, ANY, PUB, SUB = 1, 2, 4, 8
_PERMS = {"DENY": DENY, "PUB": PUB, "SUB": SUB, "PUB|SUB": PUB | SUB, "SUB|PUB": PUB | SUB}
RETRY = "%RETRY%"
TRACE_TOPIC = "RMQ_SYS_TRACE_TOPIC"

# RocketMQ's Permission.ADMIN_CODE, plus codes that decide, rewind or delete data: txmq's own and
# INVOKE_BROKER_TO_RESET_OFFSET and CLONE_GROUP_OFFSET (any signed account may move a group in RocketMQ; here an
# admin), and wipeWritePerm / addWritePerm, which take the broker out of (or back into) write routes as
# brokerPermission does.
ADMIN_CODES = frozenset({R.UPDATE_AND_CREATE_TOPIC, R.UPDATE_BROKER_CONFIG, R.DELETE_TOPIC_IN_BROKER,
                         R.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, 207, R.INVOKE_BROKER_TO_RESET_OFFSET,
                         R.CLONE_GROUP_OFFSET, R.TXMQ_LIST_TRANSACTIONS,
                         R.TXMQ_RESOLVE_TRANSACTION, R.TXMQ_RESUME_TRANSACTION, R.RESUME_CHECK_HALF_MESSAGE,
                         R.TXMQ_APPLY_EXPIRY,
                         R.WIPE_WRITE_PERM_OF_BROKER, R.ADD_WRITE_PERM_OF_BROKER})

# What the broker's own name-server port checks (it answers routes to anyone, as a RocketMQ name server):
# wipeWritePerm / addWritePerm there change this broker's write routes, as updateBrokerConfig brokerPermission
# does on the broker port. A stock mqadmin with credentials signs its name-server requests too.
NAMESRV_CHECKED = frozenset({R.WIPE_WRITE_PERM_OF_BROKER, R.ADD_WRITE_PERM_OF_BROKER})


def parse_perm(text) -> int:
    """Permission.parsePermFromString: anything it does not know is DENY."""
    return _PERMS.get(str(text).strip().upper(), DENY) if text is not None else DENY


def allowed(needed: int, owned: int) -> bool:
    if owned & DENY:
        return False
    if needed & ANY:
        return bool(owned & (PUB | SUB))
    return bool(needed & owned)


# ------------------------------------------------------------ remote addresses
def address_matcher(spec: str | None):
    """RemoteAddressStrategyFactory: '' matches nothing; '*'; 'a.b.*.*'; 'a.b.c.1-20'; 'a.b.c.{1,2}'; lists."""
    spec = (spec or "").strip()
    if not spec:
        return lambda host: False
    if spec in ("*", "*.*.*.*"):
        return lambda host: True
    if "{" in spec and spec.endswith("}"):
        prefix, _, tail = spec.partition("{")
        return _any_of([prefix + part.strip() for part in tail[:-1].split(",")])
    if "," in spec:
        return _any_of([s.strip() for s in spec.split(",") if s.strip()])
    parts = spec.split(".")
    if len(parts) != 4 or not all(p == "*" or p.isdigit() or _is_range(p) for p in parts):
        if ":" in spec:                     # IPv6: exact only
            return lambda host: host == spec
        raise ConfigError(f"remote address pattern {spec!r} is not one RocketMQ understands")
    tests = [_part_test(p) for p in parts]

    def match(host: str) -> bool:
        got = host.split(".")
        return len(got) == 4 and all(t(g) for t, g in zip(tests, got))
    return match


def _any_of(specs):
    matchers = [address_matcher(s) for s in specs]
    return lambda host: any(m(host) for m in matchers)


def _is_range(part: str) -> bool:
    lo, sep, hi = part.partition("-")
    return bool(sep) and lo.isdigit() and hi.isdigit()


def _part_test(part: str):
    if part == "*":
        return lambda got: True
    if _is_range(part):
        lo, _, hi = part.partition("-")
        return lambda got: got.isdigit() and int(lo) <= int(got) <= int(hi)
    return lambda got: got == part


# ------------------------------------------------------------------ accounts
@dataclass(frozen=True)
class Account:
    access_key: str
    secret_key: str
    white: object
    admin: bool = False
    default_topic_perm: int = DENY
    default_group_perm: int = DENY
    perms: dict = field(default_factory=dict)       # topic name or %RETRY%group -> perm


@dataclass(frozen=True)
class AclTable:
    global_white: tuple
    accounts: dict

    @classmethod
    def parse(cls, data, source: str = "plain_acl.yml") -> "AclTable":
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a mapping with 'accounts'")
        white = tuple(address_matcher(s) for s in data.get("globalWhiteRemoteAddresses") or [])
        accounts = {}
        for i, entry in enumerate(data.get("accounts") or []):
            if not isinstance(entry, dict) or not entry.get("accessKey") or not entry.get("secretKey"):
                raise ConfigError(f"{source}: account {i} needs accessKey and secretKey")
            ak, sk = str(entry["accessKey"]), str(entry["secretKey"])
            if len(ak) < 6 or len(sk) < 6:      # AclUtils.checkAccessKey / checkSecretKey
                raise ConfigError(f"{source}: account {ak!r}: accessKey and secretKey need 6 characters or more")
            perms = {}
            for key, prefix in (("topicPerms", ""), ("groupPerms", RETRY)):
                for item in entry.get(key) or []:
                    name, eq, perm = str(item).partition("=")
                    if not eq or not name.strip():
                        raise ConfigError(f"{source}: account {ak!r}: {key} entry {item!r} is not NAME=PERM")
                    perms[prefix + name.strip()] = parse_perm(perm)
            admin = entry.get("admin", False)
            accounts[ak] = Account(ak, sk, address_matcher(entry.get("whiteRemoteAddress")),
                                   admin is True or str(admin).lower() == "true",
                                   parse_perm(entry.get("defaultTopicPerm", "DENY")),
                                   parse_perm(entry.get("defaultGroupPerm", "DENY")), perms)
        return cls(white, accounts)

    @classmethod
    def load(cls, path: str) -> "AclTable":
        try:
            with open(path, "r", encoding="utf-8") as fh:
                data = yaml.safe_load(fh)
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"ACL file {path}: {exc}") from None
        if not data:        # RocketMQ refuses it too: an empty file is not "no accounts", it refuses everyone
            raise ConfigError(f"ACL file {path} has no data (empty, or only comments)")
        return cls.parse(data, path)

    def check(self, cmd, host: str) -> str | None:
        """None when the request may go on, else RocketMQ's reason for refusing it."""
        for white in self.global_white:
            if white(host):
                return None
        fields = cmd.ext_fields
        ak = fields.get(ACCESS_KEY)
        if ak is None:
            return "No accessKey is configured"
        account = self.accounts.get(ak)
        if account is None:
            return f"No acl config for {ak}"
        if account.white(host):
            return None
        sent = fields.get(SIGNATURE)
        expected = signature(signed_content(fields, cmd.body_bytes()), account.secret_key)
        if sent is None or not hmac.compare_digest(expected.encode(), sent.encode("utf-8", "replace")):
            return f"Check signature failed for accessKey={ak}"
        if cmd.code in ADMIN_CODES and not account.admin:
            return f"Need admin permission for request code={cmd.code}, but accessKey={ak} is not"
        try:
            needed = resources(cmd)
        except ValueError as exc:
            return str(exc)
        if needed.get(TRACE_TOPIC) == PUB:
            return None
        if account.admin and not account.perms:
            return None
        for name, perm in needed.items():
            is_group = name.startswith(RETRY)
            owned = account.perms.get(name)
            if owned is None:
                owned = account.default_group_perm if is_group else account.default_topic_perm
            if not allowed(perm, owned):
                what = f"group:{name[len(RETRY):]}" if is_group else f"topic:{name}"
                return f"No default permission for {what}"
        return None


def resources(cmd) -> dict[str, int]:
    """What a request touches and the permission it needs (PlainAccessValidator.parse, 4.9.8)."""
    f = cmd.ext_fields
    out: dict[str, int] = {}

    def add(name, perm):
        if name is not None:
            out[name] = perm

    code = cmd.code
    if code in (R.SEND_MESSAGE, R.SEND_MESSAGE_V2, R.SEND_BATCH_MESSAGE):
        # The topic the broker will write to, read as SendMessageRequestHeader.from_command reads it: under
        # 310 and 320 the V2 field "b", or the V1 name when "b" is absent (else that header goes unchecked).
        topic = f.get("b") if code != R.SEND_MESSAGE and "b" in f else f.get("topic")
        add(topic, SUB if topic is not None and topic.startswith(RETRY) else PUB)
    elif code == R.CONSUMER_SEND_MSG_BACK:
        add(_retry(f.get("group")), SUB)
    elif code == R.PULL_MESSAGE:
        add(f.get("topic"), SUB)
        add(_retry(f.get("consumerGroup")), SUB)
    elif code == R.QUERY_MESSAGE:
        add(f.get("topic"), SUB)
    elif code in (R.UNREGISTER_CLIENT, R.GET_CONSUMER_LIST_BY_GROUP):
        add(_retry(f.get("consumerGroup")), SUB)
    elif code == R.UPDATE_CONSUMER_OFFSET:
        add(_retry(f.get("consumerGroup")), SUB)
        add(f.get("topic"), SUB)
    elif code == R.HEART_BEAT:
        try:
            data = json.loads(cmd.body_bytes() or b"{}")
            for consumer in data.get("consumerDataSet") or []:
                add(_retry(consumer.get("groupName")), SUB)
                for sub in consumer.get("subscriptionDataSet") or []:
                    add(sub.get("topic"), SUB)
        except (ValueError, AttributeError, TypeError, RecursionError) as exc:
            raise ValueError(f"heartbeat body is not readable: {exc}") from None
    return out


def _retry(group):
    return None if group is None else RETRY + group


class PlainAcl:
    """The live table plus the file it came from; ``reload_if_changed`` swaps in a new table."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self._stamp = self._stat()
        self.table = AclTable.load(self.path)
        log.info("ACL: %d accounts from %s", len(self.table.accounts), self.path)

    def _stat(self):
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def check(self, cmd, host: str) -> str | None:
        return self.table.check(cmd, host)

    def reload_if_changed(self) -> bool:
        """Blocking (stat, read, parse): run it off the event loop. A bad file keeps the old table."""
        stamp = self._stat()
        if stamp == self._stamp or stamp is None:
            return False
        self._stamp = stamp
        try:
            table = AclTable.load(self.path)
        except ConfigError as exc:
            log.error("ACL file changed but cannot be used, keeping the previous accounts: %s", exc)
            return False
        self.table = table          # one reference swap: readers on the loop see old or new, whole
        log.warning("ACL reloaded from %s: %d accounts", self.path, len(table.accounts))
        return True
