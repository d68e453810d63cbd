import os
import sys

if not __package__:
    # Run as a file (spark-submit ops/spark/__main__.py ...): make the repository importable.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from ops.spark.cli import main  # noqa: E402

sys.exit(main())
