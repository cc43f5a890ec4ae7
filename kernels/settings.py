"""The SLIPSTREAM_* variables the kernels read, as typed settings (name, type, default, doc); the
server's list (server/settings.py) includes them. Code reads a variable through its Setting, never
os.environ directly (tests/test_docs.py checks), so each one is listed and documented once."""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Setting(Generic[T]):
    name: str                  # the environment variable
    parse: Callable[[str], T]  # its text -> the value
    default: T                 # when it is unset
    doc: str

    def get(self) -> T:
        """The value now (read on every call: tests and tools set variables after import)."""
        raw = os.environ.get(self.name)
        return self.default if raw is None else self.parse(raw)


KERNELS = Setting("SLIPSTREAM_KERNELS", str.lower, "auto",
                  "reference: run the pure-JAX reference of every kernel instead of the native CPU ones (logged)")
KV_LOAD_AHEAD: Setting[str | None] = Setting(
    "SLIPSTREAM_KV_LOAD_AHEAD", str, None,
    "all|scattered|prefetch: the CPU attention kernel's K/V load-ahead; unset: this CPU's default (logged at start-up)")
KV_HUGE_PAGES = Setting("SLIPSTREAM_KV_HUGE_PAGES", lambda text: text != "0", True,
                        "0: keep the CPU K/V cache off 2 MiB pages")

CPU_ISA: Setting[str | None] = Setting(
    "SLIPSTREAM_CPU_ISA", str.lower, None,
    "amx|avx512_vnni|avx512|avx2|portable: the highest instruction set the native CPU kernels may use (each runs "
    "its best path at or below it); unset: the best this CPU and OS allow (logged at start-up, in /metrics)")

AMX_BF16 = Setting("SLIPSTREAM_AMX_BF16", lambda text: text == "1", False,
                   "1: on AMX, q8_0-a16 weights also get bf16 hi + lo copies at load (4 bytes a weight) and calls of "
                   "64 rows or more multiply them on the BF16 tile unit: faster prefill, but results that depend on "
                   "a call's row count; unset: the int8 tile path, bit for bit the VNNI path's")

KERNEL_SETTINGS: tuple[Setting, ...] = (KERNELS, KV_LOAD_AHEAD, KV_HUGE_PAGES, CPU_ISA, AMX_BF16)
