"""Images on the device: the vision tower's program (one compile per image size), the encoded rows of the images that
steps are feeding, and a step's `embeds` input [T, D] laid out from them (StepSeq.images). The rows never leave the
device and the engine thread never waits for the tower: its program and the layout are dispatched ahead of the step
that reads them. A model without a tower never gets here: its step programs take no such input."""
from __future__ import annotations

import collections
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from slipstream.engine.api import StepBatch
from slipstream.engine.request import ImageInput


def place(buf: jax.Array, rows: jax.Array, dst: jax.Array, src: jax.Array, count: jax.Array) -> jax.Array:
    """buf [T, D] with rows [src, src + count) of rows [N, D] at [dst, dst + count): one program per (T, N), whatever
    the offsets."""
    at = jnp.arange(buf.shape[0])
    take = (at >= dst) & (at < dst + count)                                                  # [T]
    picked = rows[jnp.clip(at - dst + src, 0, rows.shape[0] - 1)]                            # [T,D]
    return jnp.where(take[:, None], picked.astype(buf.dtype), buf)


class ImageEncoder:
    """Runs the model's `encode_images` (models/llava.py) and holds each image's rows on the device from the step that
    first feeds one of them until the step that feeds its last (an image split over prefill chunks is encoded once);
    at most `max_held` images are held (a sequence preempted or cancelled mid-image leaves its image to age out).
    sharding: where the rows and a step's embeds live (the engine's replicated sharding; None: one device)."""

    def __init__(self, graphdef: nnx.GraphDef, dtype: Any, hidden_size: int, max_held: int,
                 sharding: jax.sharding.Sharding | None = None) -> None:
        def encode(state, pixels):  # pixels [1, 3, H, W] -> [rows, D]
            return nnx.merge(graphdef, state).encode_images(pixels, dtype)[0]

        placed = {} if sharding is None else {"out_shardings": sharding}
        self._jit = jax.jit(encode, **placed)
        self._place = jax.jit(place, **placed)
        self._compiled: dict[tuple[int, ...], jax.stages.Compiled] = {}  # by pixels' shape [3, H, W]
        self.dtype, self.hidden_size, self._sharding = dtype, hidden_size, sharding
        self._held: collections.OrderedDict[bytes, jax.Array] = collections.OrderedDict()
        self._blank: dict[int, jax.Array] = {}  # per token bucket: zeros [T, D], the base a step's rows are placed on
        self._max_held = max(1, max_held)
        self.encoded = 0  # images the tower ran for

    def compile(self, params: Any, size: int) -> None:
        """Compile the tower's program for size x size images now (the engine's start-up), not at the first image."""
        shape = (3, size, size)
        if shape not in self._compiled:
            self._compiled[shape] = self._jit.lower(params, jax.ShapeDtypeStruct((1, *shape), np.float32)).compile()

    def rows(self, params: Any, image: ImageInput) -> jax.Array:
        """The image's rows [length, hidden_size] on the device, in the activation dtype; its tower program dispatched
        now if it is not held."""
        held = self._held.get(image.digest)
        if held is not None:
            self._held.move_to_end(image.digest)
            return held
        pixels = np.asarray(image.pixels, np.float32)[None]
        out = self._compiled.get(pixels.shape[1:], self._jit)(params, pixels)
        self.encoded += 1
        if out.shape[0] != image.length:
            raise ValueError(f"an image of {image.length} prompt positions, but the vision tower gives {out.shape[0]} "
                             "rows for its pixels")
        self._held[image.digest] = out
        while len(self._held) > self._max_held:
            self._held.popitem(last=False)
        return out

    def embeds(self, params: Any, batch: StepBatch, t: int, embedded: np.ndarray) -> jax.Array:
        """The step's embeds [t, D] on the device, each image's rows where its chunk feeds them, and those rows marked
        in embedded i32[t]; the images whose last rows this step feeds are forgotten."""
        out = self._blank.get(t)
        if out is None:
            zeros = np.zeros((t, self.hidden_size), np.dtype(self.dtype))
            out = self._blank[t] = jax.device_put(zeros, self._sharding)
        at, done = 0, []
        for seq in batch.seqs:
            for r in seq.images:
                if not (0 <= r.at and r.at + r.count <= len(seq.token_ids)):
                    raise ValueError(f"sequence in slot {seq.slot}: image rows {r.at}..{r.at + r.count - 1} outside "
                                     f"its chunk of {len(seq.token_ids)} tokens")
                out = self._place(out, self.rows(params, r.image), np.int32(at + r.at), np.int32(r.first),
                                  np.int32(r.count))
                embedded[at + r.at:at + r.at + r.count] = 1
                if r.last:
                    done.append(r.image.digest)
            at += len(seq.token_ids)
        for digest in done:
            self._held.pop(digest, None)
        return out
