"""txmq wire and record formats: pure functions and values, no I/O (except connection.py).

This package speaks Apache RocketMQ 4.x remoting exactly, so stock clients work
against txmq, and it is the only code that knows byte layouts.
"""
