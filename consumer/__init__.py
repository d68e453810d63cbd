"""Python consumers for txmq and any RocketMQ 4.x broker."""
from .idempotent import SqliteIdempotency, message_key
from .pull_consumer import MessageQueue, MessageSelector, PullConsumer, PullResult, PullStatus
from .push_consumer import ConsumeStatus, PushConsumer
from .rebalance import allocate_averagely

__all__ = ["PullConsumer", "MessageSelector", "PullResult", "PullStatus", "MessageQueue", "PushConsumer", "ConsumeStatus",
           "SqliteIdempotency", "message_key", "allocate_averagely"]
