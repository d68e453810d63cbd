"""Transactional messages: half, decision, check-back, dead letters."""
from .service import DecisionError, TransactionService

__all__ = ["TransactionService", "DecisionError"]
