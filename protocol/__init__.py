"""txmq wire and record formats: pure functions and values, no I/O (except connection.py).

This package speaks Apache RocketMQ 4.x remoting exactly, so stock clients work
against txmq, and it is the only code that knows byte layouts.
"""

# txmq's version, kept here because every txmq package may import ``protocol`` (and nothing else of
# ours): ``python -m broker --version``, the ``txmq_build_info`` metric, setup.cfg and ``txmq.__version__``
# all read this one string. CHANGELOG.md says what each version changed.
__version__ = "0.2.0"
