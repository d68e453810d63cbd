"""The ``txmq`` import name: the wheel's import rewrite (setup.py), and both names in a checkout."""
from __future__ import annotations

import runpy
import subprocess
import sys

import pytest

from tests.support.broker_process import REPO

SETUP = runpy.run_path(str(REPO / "setup.py"), run_name="setup_under_test")
rewrite = SETUP["rewrite_imports"]


def test_rewrite_prefixes_our_imports_only():
    src = ("from protocol.errors import ConfigError\nfrom .config import X\nimport ops\nimport protocolx\n"
           "    from broker import admin\nimport producer.producer as pp\nfrom consumer import (\n    A,\n)\n"
           "text = 'from protocol import x'\n")
    assert rewrite(src) == (
        "from txmq.protocol.errors import ConfigError\nfrom .config import X\nfrom txmq import ops\n"
        "import protocolx\n    from txmq.broker import admin\nimport txmq.producer.producer as pp\n"
        "from txmq.consumer import (\n    A,\n)\ntext = 'from protocol import x'\n")


def test_rewrite_refuses_a_dotted_import_that_binds_the_old_name():
    with pytest.raises(SystemExit, match="binds the name 'broker'"):
        rewrite("import broker.server\n")


@pytest.mark.parametrize("package", SETUP["OLD"])
def test_every_module_can_be_rewritten(package):
    for path in sorted((REPO / package).rglob("*.py")):
        out = rewrite(path.read_text(encoding="utf-8"), str(path))
        compile(out, str(path), "exec")
        for line in out.splitlines():
            stripped = line.strip()
            if stripped.startswith(("from ", "import ")):
                root = stripped.split()[1].split(".")[0]
                assert root not in SETUP["OLD"], f"{path}: {line}"


def test_both_names_are_one_module_in_a_checkout():
    code = ("import txmq, txmq.broker.cli as a, broker.cli as b, txmq.producer as p, producer as q;"
            "assert a is b and p is q and txmq.Producer is q.Producer;"
            "import protocol; print(txmq.__version__ == protocol.__version__)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert done.stdout.strip() == "True", done.stderr


def test_broker_version_flag():
    import protocol

    done = subprocess.run([sys.executable, "-m", "broker", "--version"], cwd=REPO, capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0 and done.stdout.strip() == f"txmq {protocol.__version__}"
