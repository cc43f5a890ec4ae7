"""A program's host inputs packed into one int32 buffer: written on the host in place, handed to the
compiled program as its one host array (one host->device transfer, where each costs ~50-150 us on a
TPU), and cut back into its arrays by static slices inside it (the offsets are fixed per bucket).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

_DTYPES = ("int32", "uint32", "float32", "bool")  # 32-bit words; bool travels as int32 0/1


@dataclasses.dataclass(frozen=True)
class Packing:
    """Named arrays at static offsets of one int32 buffer, in the order given. Hashable: a program's
    static argument."""

    fields: tuple[tuple[str, tuple[int, ...], str], ...]  # (name, shape, dtype)

    def __post_init__(self) -> None:
        for name, _, dtype in self.fields:
            if dtype not in _DTYPES:
                raise ValueError(f"packed field {name!r}: dtype {dtype} is not one of {', '.join(_DTYPES)}")

    @functools.cached_property
    def _slices(self) -> dict[str, tuple[int, int, tuple[int, ...], str]]:
        out, at = {}, 0
        for name, shape, dtype in self.fields:
            n = math.prod(shape)
            out[name] = (at, at + n, shape, dtype)
            at += n
        return out

    @functools.cached_property
    def size(self) -> int:
        return sum(math.prod(shape) for _, shape, _ in self.fields)

    def spec(self, sharding: jax.sharding.Sharding | None = None) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((self.size,), jnp.int32, sharding=sharding)

    def host(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """A zeroed buffer and a writable view into it per field (a bool field's view is int32)."""
        buf = np.zeros(self.size, np.int32)
        views = {}
        for name, (start, stop, shape, dtype) in self._slices.items():
            part = buf[start:stop]
            views[name] = (part if dtype in ("int32", "bool") else part.view(dtype)).reshape(shape)
        return buf, views

    def unpack(self, buf: jax.Array) -> dict[str, jax.Array]:
        """Inside the program: each field of `buf` (i32[size]) in its dtype and shape."""
        out = {}
        for name, (start, stop, shape, dtype) in self._slices.items():
            part = buf[start:stop].reshape(shape)
            if dtype == "bool":
                part = part != 0
            elif dtype != "int32":
                part = jax.lax.bitcast_convert_type(part, jnp.dtype(dtype))
            out[name] = part
        return out
