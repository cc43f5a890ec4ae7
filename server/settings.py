"""Every SLIPSTREAM_* environment variable in one list: the kernels' (kernels/settings.py) and one per
serve flag, SLIPSTREAM_<FLAG> (`SLIPSTREAM_MAX_SLOTS` for --max-slots), whose type, default and doc
are the flag's. server/flags.py reads the flags' variables through `flag_env`."""
from __future__ import annotations

import argparse
import os

from slipstream.kernels.settings import KERNEL_SETTINGS, Setting


def flag_variable(flag: str) -> str:
    """--max-slots (or max-slots) -> SLIPSTREAM_MAX_SLOTS."""
    return "SLIPSTREAM_" + flag.lstrip("-").upper().replace("-", "_")


def flag_env(flag: str, default):
    """The flag's default: its variable's text when set (the caller parses it), else `default`."""
    return os.environ.get(flag_variable(flag), default)


def every_setting(parser: argparse.ArgumentParser) -> list[Setting]:
    """The kernels' settings, then one per `serve` flag (the parser of server/flags.py)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = []
    for action in sub.choices["serve"]._actions:
        long = [o for o in action.option_strings if o.startswith("--") and o != "--help"]
        if long:
            flags.append(Setting(flag_variable(long[0]), action.type or str, action.default,
                                 f"{long[0]}: {action.help or 'see the README Flags table'}"))
    return [*KERNEL_SETTINGS, *flags]
