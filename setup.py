"""Build glue for the ``txmq`` import name (docs/design.md, "Import names").

The source folders stay at the top of the checkout (``protocol/``, ``broker/``, ...), where tests and
``python -m broker`` use them under their old names. The wheel holds one top-level package, ``txmq``:
``txmq.protocol`` is built from ``protocol/`` and so on, and while the modules are copied into the
build, their imports of our packages are rewritten (``from protocol.errors import X`` becomes
``from txmq.protocol.errors import X``), so an installed txmq never needs, nor claims, the names
``protocol``, ``broker``, ``producer``, ``consumer`` or ``ops``. Everything else is in setup.cfg.
"""
from __future__ import annotations

import os
import re

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

OLD = ("protocol", "broker", "producer", "consumer", "ops")
_FROM = re.compile(r"^(\s*from\s+)(%s)(\.|\s)" % "|".join(OLD), re.M)
_IMPORT = re.compile(r"^(\s*)import\s+(%s)(\.[\w.]+)?(\s+as\s+\w+)?\s*$" % "|".join(OLD), re.M)


def rewrite_imports(source: str, path: str = "<source>") -> str:
    """Prefix every import of our five packages with ``txmq.``; refuse a form that cannot be rewritten."""
    source = _FROM.sub(lambda m: f"{m.group(1)}txmq.{m.group(2)}{m.group(3)}", source)

    def one(m: re.Match) -> str:
        indent, name, sub, alias = m.group(1), m.group(2), m.group(3) or "", m.group(4) or ""
        if not sub:                                     # import ops  ->  from txmq import ops
            return f"{indent}from txmq import {name}{alias}"
        if alias:                                       # import ops.spark as s -> import txmq.ops.spark as s
            return f"{indent}import txmq.{name}{sub}{alias}"
        raise SystemExit(f"{path}: `import {name}{sub}` binds the name {name!r}; write `from {name} import ...`")

    return _IMPORT.sub(one, source)


class BuildPy(build_py):
    """build_py that rewrites the imports of the modules it copies into the wheel."""

    def build_module(self, module, module_file, package):
        written = super().build_module(module, module_file, package)
        outfile = written[0] if isinstance(written, tuple) else self.get_module_outfile(
            self.build_lib, package.split(".") if isinstance(package, str) else package, module)
        if outfile.endswith(".py") and os.path.exists(outfile) and not getattr(self, "editable_mode", False):
            with open(outfile, encoding="utf-8") as f:
                text = f.read()
            new = rewrite_imports(text, module_file)
            if new != text:
                with open(outfile, "w", encoding="utf-8") as f:
                    f.write(new)
        return written


def _packages() -> tuple[list[str], dict[str, str]]:
    packages, package_dir = ["txmq"], {"txmq": "txmq"}
    for name in OLD:
        for pkg in [name] + [f"{name}.{p}" for p in find_packages(where=name)]:
            packages.append(f"txmq.{pkg}")
            package_dir[f"txmq.{pkg}"] = pkg.replace(".", "/")
    return packages, package_dir


if __name__ == "__main__":      # the build backend runs this file as __main__; tests import it
    packages, package_dir = _packages()
    setup(packages=packages, package_dir=package_dir, cmdclass={"build_py": BuildPy})
