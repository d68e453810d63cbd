"""``python -m broker``: flags and BROKER_* environment variables generated from BrokerConfig.

Precedence: command line, then environment, then the field's default.
``python -m broker admin ...`` runs the administration client instead,
``python -m broker namesrv ...`` a stand-alone name server (flags and NAMESRV_*
variables from NamesrvConfig), ``python -m broker cluster ...`` a name server
and N brokers on this machine (broker/cluster.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Sequence

from protocol import __version__
from protocol.errors import ConfigError

from .config import BrokerConfig

ENV_PREFIX = "BROKER_"


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{text!r} is not a boolean")


def _converter(kind):
    if kind in (bool, "bool"):
        return _parse_bool
    if kind in (int, "int"):
        return int
    if kind in (float, "float"):
        return float
    return str


def build_parser(cls=BrokerConfig, prefix: str = ENV_PREFIX, prog: str = "python -m broker",
                 what: str = "txmq broker: RocketMQ 4.x-compatible transactional message broker.") -> argparse.ArgumentParser:
    # allow_abbrev=False: a prefix of a flag was taken for it (`--max-undecided 8`, before that flag existed, set
    # --max-undecided-per-group without a word), and a flag added later changed what an old command line meant
    parser = argparse.ArgumentParser(
        prog=prog, allow_abbrev=False,
        description=f"{what} Every flag can also be set as the environment variable {prefix}<NAME>.",
    )
    parser.add_argument("--version", action="version", version=f"txmq {__version__}")
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kind = f.type if not isinstance(f.type, str) else f.type
        help_text = f"{f.metadata['doc']} [env {prefix}{f.name.upper()}]".replace("%", "%%")
        if kind in (bool, "bool"):
            parser.add_argument(flag, dest=f.name, type=_parse_bool, nargs="?", const=True, default=None,
                                metavar="BOOL", help=help_text + f" (default: {f.default})")
        else:
            parser.add_argument(flag, dest=f.name, type=_converter(kind), default=None,
                                choices=f.metadata.get("choices"), help=help_text + f" (default: {f.default})")
    return parser


def config_from(argv: Sequence[str] | None = None, environ: dict | None = None, *, cls=BrokerConfig,
                prefix: str = ENV_PREFIX, parser: argparse.ArgumentParser | None = None):
    environ = os.environ if environ is None else environ
    args = (parser or build_parser(cls, prefix)).parse_args(argv)
    values = {}
    for f in dataclasses.fields(cls):
        cli_value = getattr(args, f.name)
        if cli_value is not None:
            values[f.name] = cli_value
            continue
        env_value = environ.get(prefix + f.name.upper())
        if env_value is not None:
            try:
                values[f.name] = _converter(f.type)(env_value)
            except ValueError as exc:
                raise ConfigError(f"{prefix}{f.name.upper()}={env_value!r}: {exc}") from None
    return cls(**values)


def namesrv_main(argv: Sequence[str]) -> int:
    """``python -m broker namesrv``: a name server only, for brokers started with --namesrv-addr."""
    from .namesrv.config import NamesrvConfig
    parser = build_parser(NamesrvConfig, "NAMESRV_", "python -m broker namesrv",
                          "txmq stand-alone name server: brokers register with it (--namesrv-addr), "
                          "clients ask it for routes.")
    try:
        config = config_from(argv, cls=NamesrvConfig, prefix="NAMESRV_", parser=parser)
    except ConfigError as exc:
        print(f"txmq-namesrv: cannot start: {exc}", file=sys.stderr)
        return 1
    from .namesrv.server import run
    return run(config)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "admin":
        from .admin import main as admin_main
        return admin_main(argv[1:])
    if argv and argv[0] == "namesrv":
        return namesrv_main(argv[1:])
    if argv and argv[0] == "cluster":
        from .cluster import main as cluster_main
        return cluster_main(argv[1:])
    try:
        config = config_from(argv)
    except ConfigError as exc:      # a start failure like any other: one line, exit code 1
        print(f"txmq-broker: cannot start: {exc}", file=sys.stderr)
        return 1
    from .server import run
    return run(config)
