"""Images on the device: the vision tower's program (one compile per image size) and the encoded rows of the images
that steps are feeding, laid out as a step's `embeds` input (StepSeq.images). A model without a tower never gets here:
its step programs take no such input."""
from __future__ import annotations

import collections
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from slipstream.engine.api import StepBatch
from slipstream.engine.request import ImageInput


class ImageEncoder:
    """Runs the model's `encode_images` (models/llava.py) and holds each image's rows on the host from the step that
    first feeds one of them until the step that feeds its last (an image split over prefill chunks is encoded once);
    at most `max_held` images are held (a sequence preempted or cancelled mid-image leaves its image to age out)."""

    def __init__(self, graphdef: nnx.GraphDef, dtype: Any, max_held: int) -> None:
        def encode(state, pixels):
            return nnx.merge(graphdef, state).encode_images(pixels, dtype)

        self._jit = jax.jit(encode)
        self._compiled: dict[tuple[int, ...], jax.stages.Compiled] = {}  # by pixels' shape [3, H, W]
        self.dtype = np.dtype(dtype)
        self._held: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()
        self._max_held = max(1, max_held)
        self.encoded = 0        # images the tower ran for
        self.seconds = 0.0      # and its time (host and device: the engine thread waits for the rows)

    def compile(self, params: Any, size: int) -> None:
        """Compile the tower's program for size x size images now (the engine's start-up), not at the first image."""
        shape = (3, size, size)
        if shape not in self._compiled:
            self._compiled[shape] = self._jit.lower(params, jax.ShapeDtypeStruct((1, *shape), np.float32)).compile()

    def rows(self, params: Any, image: ImageInput) -> np.ndarray:
        """The image's rows [length, hidden_size] in the activation dtype, encoded now if not held."""
        held = self._held.get(image.digest)
        if held is not None:
            self._held.move_to_end(image.digest)
            return held
        start = time.perf_counter()
        pixels = np.asarray(image.pixels, np.float32)[None]
        program = self._compiled.get(pixels.shape[1:], self._jit)
        out = np.asarray(program(params, pixels)[0], self.dtype)
        self.seconds += time.perf_counter() - start
        self.encoded += 1
        if out.shape[0] != image.length:
            raise ValueError(f"an image of {image.length} prompt positions, but the vision tower gives {out.shape[0]} "
                             "rows for its pixels")
        self._held[image.digest] = out
        while len(self._held) > self._max_held:
            self._held.popitem(last=False)
        return out

    def fill(self, params: Any, batch: StepBatch, embeds: np.ndarray, embedded: np.ndarray) -> None:
        """Write the step's image rows into embeds [T, D] and mark them in embedded i32[T]; forget the images whose
        last rows this step feeds."""
        at, done = 0, []
        for seq in batch.seqs:
            for r in seq.images:
                if not (0 <= r.at and r.at + r.count <= len(seq.token_ids)):
                    raise ValueError(f"sequence in slot {seq.slot}: image rows {r.at}..{r.at + r.count - 1} outside "
                                     f"its chunk of {len(seq.token_ids)} tokens")
                rows = self.rows(params, r.image)
                embeds[at + r.at:at + r.at + r.count] = rows[r.first:r.first + r.count]
                embedded[at + r.at:at + r.at + r.count] = 1
                if r.last:
                    done.append(r.image.digest)
            at += len(seq.token_ids)
        for digest in done:
            self._held.pop(digest, None)
