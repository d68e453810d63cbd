"""The name server on its own (``python -m broker namesrv``): brokers register, clients ask for routes.

table.py holds the state (pure, clock injected), processors.py the request
handlers, server.py the process. A single broker keeps its embedded name
server (broker/processors/namesrv.py) and needs none of this.
"""
from .table import BrokerLive, RouteTable

__all__ = ["BrokerLive", "RouteTable"]
