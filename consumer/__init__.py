"""Python consumers for txmq and any RocketMQ 4.x broker."""
from .pull_consumer import MessageQueue, PullConsumer, PullResult, PullStatus
from .rebalance import allocate_averagely

__all__ = ["PullConsumer", "PullResult", "PullStatus", "MessageQueue", "allocate_averagely"]
