"""Delay levels for tests that must not sleep for RocketMQ's real ones (level n = n x 100 ms; levels 3 + n
for retries stay short), and a helper to start a broker with them."""

FAST_DELAY_LEVELS = " ".join(f"{n * 100}ms" for n in range(1, 19))
FAST = ("--message-delay-level", FAST_DELAY_LEVELS)
