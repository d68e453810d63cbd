"""``python -m txmq``: the broker, as ``txmq-broker`` and ``python -m broker``."""
import sys

from txmq.broker.cli import main

sys.exit(main())
