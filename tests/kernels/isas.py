"""The instruction sets a native kernel module can run on this CPU, for tests of every path."""
from __future__ import annotations


def runnable_isas(ext, names: tuple[str, ...]) -> list[str]:
    """Those of `names` that `ext.set_isa` accepts here (the detected choice is restored)."""
    out = []
    for isa in names:
        try:
            prev = ext.set_isa(isa)
        except ValueError:
            continue
        ext.set_isa(prev)
        out.append(isa)
    return out
