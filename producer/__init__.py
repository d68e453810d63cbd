"""Python producers for txmq and any RocketMQ 4.x broker: Producer and TransactionProducer."""
from .producer import MessageQueue, Producer, SendResult, SendStatus
from .transaction import LocalTransactionState, TransactionListener, TransactionProducer, TransactionSendResult

__all__ = ["Producer", "SendResult", "SendStatus", "MessageQueue", "TransactionProducer", "TransactionListener",
           "LocalTransactionState", "TransactionSendResult"]
