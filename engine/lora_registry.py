"""LoRA adapters on the host: the registry of loaded adapters by name (the server's; thread-safe), and
the slot table a scheduler binds running sequences' adapters to device slots with (LRU, a slot in use
is never rebound). Plain Python: no JAX; the engine writes a slot when a sequence is inserted."""
from __future__ import annotations

import collections
import threading
from typing import Callable

from slipstream.models.lora import LoraAdapter, LoraError, resolve_under


class LoraRegistry:
    """name -> LoraAdapter. `load(name, path)` reads a PEFT directory under `root` with `read`
    (models.lora.load_adapter bound to the base model); a request holds its adapter object, so
    unloading one never disturbs requests already using it."""

    def __init__(self, read: Callable[[str, str], LoraAdapter], root: str | None) -> None:
        self._read, self.root = read, root
        self._adapters: dict[str, LoraAdapter] = {}
        self._lock = threading.Lock()

    def load(self, name: str, path: str, *, reserved: frozenset[str] = frozenset()) -> LoraAdapter:
        """Read, check and register an adapter; LoraError (nothing changes) if it is bad, its path
        is outside the root, or the name is taken (`reserved`: the base model's names)."""
        if not name or name in reserved:
            raise LoraError(f"lora_name {name!r} is empty or the base model's name")
        with self._lock:
            if name in self._adapters:
                raise LoraError(f"lora_name {name!r} is already loaded; unload it first")
        adapter = self._read(name, resolve_under(self.root or "", path))
        with self._lock:
            if name in self._adapters:
                raise LoraError(f"lora_name {name!r} is already loaded; unload it first")
            self._adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> LoraAdapter:
        """Forget it (KeyError if unknown): new requests cannot pick it; running ones finish with it."""
        with self._lock:
            return self._adapters.pop(name)

    def get(self, name: str) -> LoraAdapter | None:
        with self._lock:
            return self._adapters.get(name)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._adapters)


class LoraSlotTable:
    """Which adapter each device slot 1..max_loras holds, and how many running sequences use it.
    `acquire` reuses the slot that holds the adapter, else takes a never-used slot or the least
    recently used idle one; None when every slot is in use (the sequence waits)."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._holds: dict[int, bytes] = {}                       # slot -> adapter digest
        self._slot_of: dict[bytes, int] = {}
        self._refs = collections.Counter()
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict(
            (s, None) for s in range(1, max_loras + 1))          # unused slots, least recent first
        self.swaps = 0                                            # slots rebound to another adapter

    def acquire(self, adapter: LoraAdapter) -> int | None:
        slot = self._slot_of.get(adapter.digest)
        if slot is None:
            if not self._idle:
                return None
            slot, _ = self._idle.popitem(last=False)
            if (old := self._holds.pop(slot, None)) is not None:
                del self._slot_of[old]
                self.swaps += 1
            self._holds[slot], self._slot_of[adapter.digest] = adapter.digest, slot
        else:
            self._idle.pop(slot, None)
        self._refs[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        if self._refs[slot] <= 0:
            raise ValueError(f"LoRA slot {slot} is not in use")
        self._refs[slot] -= 1
        if not self._refs[slot]:
            del self._refs[slot]
            self._idle[slot] = None                               # most recently used

    def in_use(self) -> dict[int, int]:
        """slot -> running sequences using it."""
        return dict(self._refs)
