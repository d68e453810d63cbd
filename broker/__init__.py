"""The txmq broker: name-server and broker roles, the store, transactions, metrics."""
