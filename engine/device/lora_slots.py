"""LoRA adapters on the device: per targeted module one fixed-size stack of every slot's A and B
(A [L, in, S*r], B [L, S*r, out]; slot s in columns (s-1)*r .. s*r, slot 0 the base model with no
columns), written in place by one precompiled program, and attached to the step's linear weights as
quantization.lora.LoraWeight. Shapes never depend on which adapters are loaded: no recompiles.

`packed` (XLA:CPU with kernels/lora_delta's native kernel, f32 adapters): each stack is kept packed in
kernels/f32_matmul's column panels ([L, Np/32, K*32], quantization.lora.PackedStack), and the kernel
reads layer i's A and B where they lie, each token's own slot only; a scan over plain [L, ...] stacks
made XLA copy each layer's slice out first (8 of the 24 ms LoRA added to a 32-decode step on the
default model)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from slipstream.kernels import f32_matmul as f32
from slipstream.models.lora import LoraAdapter, Target
from slipstream.quantization.lora import LoraWeight, PackedStack


class LoraSlots:
    """`max_loras` adapter slots (1..max_loras) of rank up to `max_rank` over `targets`, in `dtype`."""

    def __init__(self, targets: dict[str, Target], num_layers: int, max_loras: int, max_rank: int, dtype, *,
                 packed: bool = False) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"LoRA slots need max_loras >= 1 and max_rank >= 1, got {max_loras}, {max_rank}")
        self.targets, self.num_layers = targets, num_layers
        self.max_loras, self.rank, self.dtype = max_loras, max_rank, jnp.dtype(dtype)
        self.packed = packed
        if packed and self.dtype != jnp.float32:
            raise ValueError(f"packed LoRA stacks are f32 (kernels/f32_matmul), not {self.dtype}")
        cols = max_loras * max_rank
        if packed:  # A [L, ceil(S*r/32), in*32], B [L, ceil(out/32), S*r*32]
            self.stacks = {m: (jnp.zeros((num_layers, f32.padded(cols) // f32.PANEL, t.d_in * f32.PANEL), self.dtype),
                               jnp.zeros((num_layers, f32.padded(t.d_out) // f32.PANEL, cols * f32.PANEL), self.dtype))
                           for m, t in targets.items()}
        else:
            self.stacks = {m: (jnp.zeros((num_layers, t.d_in, cols), self.dtype),     # [L,in,S*r]
                               jnp.zeros((num_layers, cols, t.d_out), self.dtype))    # [L,S*r,out]
                           for m, t in targets.items()}
        self.resident: list[bytes | None] = [None] * (max_loras + 1)  # adapter digest per slot
        self._write_jit = jax.jit(self._write_slot, donate_argnums=(0,))
        self._write = None  # its compiled program (compile())
        self._zeros = {m: (np.zeros((num_layers, t.d_in, max_rank), self.dtype),
                           np.zeros((num_layers, max_rank, t.d_out), self.dtype)) for m, t in targets.items()}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.stacks.values())

    def _write_slot(self, stacks, slot, new):
        r = self.rank
        start = (slot - 1) * r
        if not self.packed:
            return {m: (jax.lax.dynamic_update_slice(a, new[m][0], (0, 0, start)),
                        jax.lax.dynamic_update_slice(b, new[m][1], (0, start, 0)))
                    for m, (a, b) in stacks.items()}
        out = {}
        p = f32.PANEL
        cols = start + jnp.arange(r, dtype=jnp.int32)  # the slot's columns of A: panel cols // 32, lane cols % 32
        for m, (a, b) in stacks.items():
            na, nb = new[m]                                                           # [L,in,r], [L,r,out]
            lay, pa, kp = a.shape
            a4 = a.reshape(lay, pa, kp // p, p).at[:, cols // p, :, cols % p].set(jnp.moveaxis(na, 2, 0))
            lay, pb, kp = b.shape
            d_out = nb.shape[-1]
            nb = jnp.pad(nb, ((0, 0), (0, 0), (0, pb * p - d_out))).reshape(lay, r, pb, p).transpose(0, 2, 1, 3)
            b4 = jax.lax.dynamic_update_slice(b.reshape(lay, pb, kp // p, p), nb, (0, 0, start, 0))
            out[m] = (a4.reshape(a.shape), b4.reshape(b.shape))
        return out

    def compile(self) -> None:
        """Compile the slot writer now, ahead of time, so loading adapters never compiles."""
        if self._write is None:
            self._write = self._write_jit.lower(self.stacks, np.int32(1), self._zeros).compile()

    def holds(self, slot: int, adapter: LoraAdapter) -> bool:
        return 1 <= slot <= self.max_loras and self.resident[slot] == adapter.digest

    def ensure(self, slot: int, adapter: LoraAdapter) -> None:
        """Make `slot` hold `adapter` (a no-op when it already does): its A and B padded to the slot
        rank, zeros for the modules it does not target. In device order after every step already
        launched, which read the old contents (the host's slot table never rebinds a slot in use)."""
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"LoRA slot {slot} out of range [1, {self.max_loras}]")
        if self.resident[slot] == adapter.digest:
            return
        if adapter.rank > self.rank:
            raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank} > the slots' {self.rank}")
        unknown = set(adapter.weights) - set(self.targets)
        if unknown:
            raise ValueError(f"adapter {adapter.name!r} targets {sorted(unknown)}, not linears of this model")
        self.compile()
        new = {}
        for m, (za, zb) in self._zeros.items():
            if m not in adapter.weights:
                new[m] = (za, zb)
                continue
            a, b = adapter.weights[m]
            pa, pb = za.copy(), zb.copy()
            pa[:, :, :adapter.rank] = a
            pb[:, :adapter.rank, :] = b
            new[m] = (pa, pb)
        self.stacks = self._write(self.stacks, np.int32(slot), new)
        self.resident[slot] = adapter.digest

    def attach(self, state: nnx.State, stacks, token_slots: jax.Array) -> nnx.State:
        """Inside the jitted step: `state` with every targeted linear weight wrapped as a LoraWeight
        over `stacks` and the tokens' slots i32[T] (0: base model)."""
        flat = dict(nnx.to_flat_state(state))
        slots = jnp.broadcast_to(token_slots, (self.num_layers, token_slots.shape[0]))  # [L,T]
        for m, (a, b) in stacks.items():
            var = flat[tuple(self.targets[m].path.split("."))]
            if self.packed:
                a, b = PackedStack(a, self.max_loras * self.rank), PackedStack(b, self.targets[m].d_out)
            flat[tuple(self.targets[m].path.split("."))] = var.replace(
                LoraWeight(var.get_value(), a, b, slots, self.rank))
        return nnx.from_flat_state(list(flat.items()))
