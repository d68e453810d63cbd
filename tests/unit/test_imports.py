"""The layering rules of ARCHITECTURE section 1, checked on the source with ``ast`` (nothing is imported).

* ``protocol`` imports nothing of ours; only protocol/connection.py imports asyncio.
* ``broker``, ``producer`` and ``consumer`` may import ``protocol``, never each other.
* ``ops`` imports only ``protocol`` of ours.
* Only protocol/connection.py, broker/server.py and broker/namesrv/server.py (the stand-alone
  name server) may open sockets: call
  asyncio's start_server / open_connection (and unix variants), a loop's
  create_server / create_connection / create_datagram_endpoint / sock_* methods,
  or socket.socket / create_connection / create_server / socketpair / fromfd.
* Only broker/store/commit_log.py writes commit-log segment files. This one is a
  heuristic, since types are not known statically. Two signs of a segment write
  are looked for outside commit_log.py:
    1. a module that imports broker.store.commit_log (so it can hold a Segment)
       assigns into a mapping (``x.mm[...] = ...``) or calls a write method on one
       (``x.mm.write(...)``, ``write_byte``, ``move``, ``resize``);
    2. a function whose code names the ``"commitlog"`` directory also opens a file
       for writing: ``open``/``io.open``/``Path.open``/``os.fdopen`` with a w/a/x/+ mode, ``os.open``
       with a write flag, ``mmap.mmap`` without ``ACCESS_READ``, ``write_bytes``,
       ``write_text``, ``truncate``/``ftruncate``.
  Consume-queue files and other store files are written through the same
  MappedFile mechanism and are not segments, so they pass.

Every check applies to whatever files exist, so a package not written yet passes.
The checkers are themselves tested on small snippets at the end.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OURS = {"protocol", "broker", "producer", "consumer", "ops", "tests", "bench", "txmq"}
ALLOWED = {
    "protocol": {"protocol"},
    "broker": {"broker", "protocol"},
    "producer": {"producer", "protocol"},
    "consumer": {"consumer", "protocol"},
    "ops": {"ops", "protocol"},
    "txmq": {"txmq", "protocol", "broker", "producer", "consumer", "ops"},   # the umbrella name (setup.py)
}
SOCKET_OPENERS = {"protocol/connection.py", "broker/server.py", "broker/namesrv/server.py"}
SEGMENT_WRITER = "broker/store/commit_log.py"


def sources(*packages: str) -> list[tuple[str, ast.Module]]:
    out = []
    for package in packages:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            out.append((rel, ast.parse(path.read_text(encoding="utf-8"), filename=rel)))
    return out


def module_name(rel: str) -> list[str]:
    parts = rel[:-3].split("/")
    return parts[:-1] if parts[-1] == "__init__" else parts


# ------------------------------------------------------------------ imports
def imported_modules(rel: str, tree: ast.AST) -> list[tuple[int, str]]:
    """(line, absolute dotted module) for every import, relative ones resolved, dynamic ones included."""
    package = module_name(rel) if rel.endswith("__init__.py") else module_name(rel)[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1] if node.level > 1 else package
                found.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
            else:
                found.append((node.lineno, node.module))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            found.append((node.lineno, node.args[0].value))
    return found


def import_violations(rel: str, tree: ast.AST) -> list[str]:
    top = rel.split("/")[0]
    allowed = ALLOWED[top]
    bad = []
    for line, module in imported_modules(rel, tree):
        root = module.split(".")[0]
        if root in OURS and root not in allowed:
            bad.append(f"{rel}:{line} imports {module}")
        if top == "protocol" and root == "asyncio" and rel != "protocol/connection.py":
            bad.append(f"{rel}:{line} imports asyncio (protocol is sans-IO except connection.py)")
    return bad


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_import_rules(package):
    bad = [v for rel, tree in sources(package) for v in import_violations(rel, tree)]
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------ sockets
ASYNCIO_OPENERS = {"start_server", "open_connection", "start_unix_server", "open_unix_connection"}
LOOP_OPENERS = {"create_server", "create_connection", "create_unix_server", "create_unix_connection",
                "create_datagram_endpoint", "connect_accepted_socket", "sock_connect", "sock_accept"}
SOCKET_MODULE_OPENERS = {"socket", "create_connection", "create_server", "socketpair", "fromfd"}


def socket_calls(tree: ast.AST) -> list[tuple[int, str]]:
    # Which local names stand for the asyncio / socket modules or their functions.
    module_alias: dict[str, str] = {}
    function_alias: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in ("asyncio", "socket"):
                    module_alias[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module in ("asyncio", "socket"):
            for alias in node.names:
                function_alias[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute):
            owner = func.value.id if isinstance(func.value, ast.Name) else None
            module = module_alias.get(owner)
            if module == "asyncio" and func.attr in ASYNCIO_OPENERS | LOOP_OPENERS:
                calls.append((node.lineno, f"asyncio.{func.attr}"))
            elif module == "socket" and func.attr in SOCKET_MODULE_OPENERS:
                calls.append((node.lineno, f"socket.{func.attr}"))
            elif module is None and func.attr in LOOP_OPENERS:
                calls.append((node.lineno, f"<loop>.{func.attr}"))  # any receiver: a loop is not typed
        elif isinstance(func, ast.Name) and func.id in function_alias:
            target = function_alias[func.id]
            module, name = target.split(".")
            if (module == "asyncio" and name in ASYNCIO_OPENERS | LOOP_OPENERS) or \
                    (module == "socket" and name in SOCKET_MODULE_OPENERS):
                calls.append((node.lineno, target))
    return calls


def test_only_connection_and_server_open_sockets():
    bad = [f"{rel}:{line} calls {what}" for rel, tree in sources(*ALLOWED) if rel not in SOCKET_OPENERS
           for line, what in socket_calls(tree)]
    assert not bad, "\n".join(bad)


# ----------------------------------------------------------------- segments
MMAP_WRITE_METHODS = {"write", "write_byte", "move", "resize"}
WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_APPEND", "O_TRUNC", "O_CREAT"}


def _imports_commit_log(rel: str, tree: ast.AST) -> bool:
    return any(module.endswith("store.commit_log") or module == "broker.store.commit_log"
               for _, module in imported_modules(rel, tree))


def _is_mm(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "mm"


def mmap_writes(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AugAssign) else []
        lines += [node.lineno for t in targets if isinstance(t, ast.Subscript) and _is_mm(t.value)]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in MMAP_WRITE_METHODS and _is_mm(node.func.value):
            lines.append(node.lineno)
    return lines


def _mode_writes(node: ast.Call, position: int) -> bool:
    mode = node.args[position] if len(node.args) > position else \
        next((k.value for k in node.keywords if k.arg == "mode"), None)
    if mode is None:
        return False
    if not isinstance(mode, ast.Constant):
        return True  # a computed mode: assume the worst
    return any(ch in str(mode.value) for ch in "wax+")


def write_opens(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else None
        if name == "open" and owner == "os":
            flags = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
            if flags & WRITE_FLAGS:
                lines.append(node.lineno)
        elif name == "open" and _mode_writes(node, 0 if isinstance(func, ast.Attribute) and owner != "io" else 1):
            lines.append(node.lineno)
        elif name == "fdopen" and _mode_writes(node, 1):
            lines.append(node.lineno)
        elif name == "mmap" and not any(isinstance(n, ast.Attribute) and n.attr in ("ACCESS_READ",)
                                        for n in ast.walk(node)):
            lines.append(node.lineno)
        elif name in ("write_bytes", "write_text", "truncate", "ftruncate"):
            lines.append(node.lineno)
    return lines


def _names_commitlog(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str) and "commitlog" in n.value.lower()
               for n in ast.walk(node))


def segment_write_violations(rel: str, tree: ast.AST) -> list[str]:
    if rel == SEGMENT_WRITER:
        return []
    bad = []
    if _imports_commit_log(rel, tree):
        bad += [f"{rel}:{line} writes into a mapping while holding commit-log segments" for line in mmap_writes(tree)]
    flagged: set[int] = set()
    for func in ast.walk(tree):
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) and _names_commitlog(func):
            for line in write_opens(func):
                if line not in flagged:  # a nested function is walked with its parent too
                    flagged.add(line)
                    bad.append(f"{rel}:{line} opens a file for writing in {func.name}, which names the "
                               "commitlog directory")
    return bad


def test_only_commit_log_writes_segments():
    bad = [v for rel, tree in sources(*ALLOWED) for v in segment_write_violations(rel, tree)]
    assert not bad, "\n".join(bad)


# ------------------------------------------------------ the checkers work
def _tree(src: str) -> ast.Module:
    return ast.parse(src)


@pytest.mark.parametrize("rel, src, bad", [
    ("protocol/x.py", "import broker.store\n", True),
    ("protocol/x.py", "from broker import server\n", True),
    ("protocol/x.py", "import asyncio\n", True),
    ("protocol/connection.py", "import asyncio\n", False),
    ("protocol/x.py", "from .codes import RequestCode\nimport json\n", False),
    ("broker/processors/send.py", "from ...producer import Producer\n", True),
    ("broker/processors/send.py", "from ..store import x\nfrom protocol.message import y\n", False),
    ("producer/p.py", "from consumer.rebalance import allocate\n", True),
    ("consumer/c.py", "def f():\n    import importlib\n    importlib.import_module('broker.config')\n", True),
    ("ops/spark/job.py", "from broker.store import x\n", True),
    ("ops/spark/job.py", "from protocol.message import decode_records\nfrom . import plan\n", False),
])
def test_import_checker(rel, src, bad):
    assert bool(import_violations(rel, _tree(src))) == bad


@pytest.mark.parametrize("src, n", [
    ("import asyncio\nasync def f():\n    await asyncio.open_connection('h', 1)\n", 1),
    ("from asyncio import start_server as s\nasync def f():\n    await s(None, 'h', 1)\n", 1),
    ("async def f(loop):\n    await loop.create_connection(None, 'h', 1)\n", 1),
    ("import socket as so\nso.socket()\nso.create_connection(('h', 1))\n", 2),
    ("from protocol.connection import open_connection\nasync def f():\n    await open_connection('h', 1)\n", 0),
    ("import socket\nsocket.gethostbyname('localhost')\n", 0),
])
def test_socket_checker(src, n):
    assert len(socket_calls(_tree(src))) == n


@pytest.mark.parametrize("rel, src, bad", [
    ("broker/store/recovery.py", "from .commit_log import Segment\ndef f(seg):\n    seg.mm[0:4] = b'x'\n", True),
    ("broker/store/recovery.py", "from .commit_log import Segment\ndef f(seg):\n    seg.mm.write(b'x')\n", True),
    ("broker/store/recovery.py", "from .commit_log import Segment\ndef f(clog, seg):\n    clog.zero(seg, 0, 4)\n",
     False),
    ("broker/store/consume_queue.py", "def f(mf):\n    mf.mm[0:4] = b'x'\n", False),
    ("broker/x.py", "import os\ndef f(d):\n    open(os.path.join(d, 'commitlog', 'n'), 'r+b')\n", True),
    ("broker/x.py", "import os\ndef f(d):\n    os.open(os.path.join(d, 'commitlog'), os.O_RDWR)\n", True),
    ("broker/x.py", "import os\ndef f(d, fd):\n    d += '/commitlog'\n    os.fdopen(fd, 'ab')\n", True),
    ("ops/spark/s.py", "import os, mmap\ndef f(d):\n    p = os.path.join(d, 'commitlog')\n"
                       "    with open(p, 'rb') as fh:\n        mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)\n",
     False),
    ("broker/x.py", "import mmap\ndef f(d, fd):\n    d = d + '/commitlog'\n    mmap.mmap(fd, 0)\n", True),
    ("broker/store/commit_log.py", "def f(seg):\n    seg.mm[0:4] = b'x'\n    open('commitlog/0', 'wb')\n", False),
])
def test_segment_write_checker(rel, src, bad):
    assert bool(segment_write_violations(rel, _tree(src))) == bad
