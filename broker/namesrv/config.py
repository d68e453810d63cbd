"""NamesrvConfig: the stand-alone name server's settings (flags and NAMESRV_* environment, as the broker's)."""
from __future__ import annotations

from dataclasses import dataclass

from protocol.errors import ConfigError

from ..config import public_host, setting


@dataclass(frozen=True)
class NamesrvConfig:
    host: str = setting("127.0.0.1", "Address the name server binds to. Loopback by default.")
    port: int = setting(9876, "Name-server port (RocketMQ's default). 0 picks a free port.")
    advertised_host: str = setting("", "Address printed in the LISTENING line. Empty: the bind host, or 127.0.0.1 when binding all interfaces.")
    broker_expire_ms: int = setting(120000, "A broker not registered again for this long leaves the routes (RocketMQ's BROKER_CHANNEL_EXPIRED_TIME, 120 s; brokers register every 30 s). A broker whose connection closes leaves at once. A connection that sent nothing for this long is closed (its peer went away without closing it, and held its address's room in max_connections_per_host).")
    scan_interval_ms: int = setting(10000, "How often brokers are checked for expiry (RocketMQ's 10 s).")
    max_connections: int = setting(10000, "Connections accepted at once; more are closed on accept.")
    max_connections_per_host: int = setting(2000, "Connections accepted at once from one remote address; more are closed on accept (logged at most every 10 s), so one client cannot take every connection and leave the others without routes.")
    max_broker_addresses_per_host: int = setting(64, "Broker addresses the connections from one remote address may have registered at once (a broker registers one; its slaves, one each). A new one past it is refused SYSTEM_BUSY naming this limit, with a WARNING: anyone may register any address with its topic table, and one connection registering address after address grew the routes without bound.")
    ipv6_client_prefix: int = setting(64, "IPv6 clients are counted by this prefix of their address for the per-host limits (connections, broker addresses): 64, a /64, is what one IPv6 host or site is given, and a client picking a source address per connection from it got round them when counted by address. But a data-centre or cloud subnet is one /64 holding many hosts (brokers too), which then share one host's room: 128 counts each address as itself. ::1, link-local and IPv4-mapped addresses are counted as themselves whatever this is.")
    max_frame_size: int = setting(16 * 1024 * 1024, "Largest frame accepted (RocketMQ's 16 MiB).")
    max_total_write_buffer: int = setting(64 * 1024 * 1024, "Unread reply bytes all connections may hold together. Past it, the connections holding the most (those that stopped reading first) are closed, largest first, until the total is back under it, each logged: without it, clients that ask and never read could each hold up to 64 MiB of replies, and a hundred of them would have the name server killed for its memory, leaving every client without routes. A name server's replies are small (routes, topic lists), so a client that reads holds little for long; the broker's is 256 MiB.")
    max_total_read_buffer: int = setting(64 * 1024 * 1024, "Bytes of request frames received but not yet whole that all connections may hold together. Past it, the connections whose frame has been unfinished longest are closed first, each logged: a frame may declare up to max_frame_size and arrive as slowly as its sender likes, and a few hundred connections each holding most of one would have the name server killed for its memory. A broker's registration, its largest request, is a few MiB at most.")
    kv_config_path: str = setting("~/namesrv/kvConfig.json", "File of the KV config (mqadmin updateKvConfig, updateOrderConf; RocketMQ's kvConfigPath and default).")
    log_level: str = setting("INFO", "Logging level.", choices=("DEBUG", "INFO", "WARNING", "ERROR"))

    def __post_init__(self) -> None:
        if self.log_level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"log_level={self.log_level!r}: choose one of DEBUG, INFO, WARNING, ERROR")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port={self.port} is not a port number")
        for name in ("broker_expire_ms", "scan_interval_ms", "max_connections", "max_connections_per_host", "max_frame_size",
                     "max_broker_addresses_per_host", "max_total_write_buffer",
                     "max_total_read_buffer"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be positive")
        if not 1 <= self.ipv6_client_prefix <= 128:
            raise ConfigError(f"ipv6_client_prefix={self.ipv6_client_prefix} is not an IPv6 prefix length (1 to 128)")

    @property
    def public_host(self) -> str:
        return public_host(self.host, self.advertised_host)
