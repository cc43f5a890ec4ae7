"""Idefics3's and SmolVLM's image preprocessing (transformers' Idefics3ImageProcessor from preprocessor_config.json) and
prompt layout (Idefics3Processor's): the longest edge resized, the image cut into square tiles of the tower's size plus
a global image (image splitting), rescaled and normalized; and the text that takes the place of its <image>. Pillow
only: a decoded image in, the tiles' pixels out."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
from PIL import Image

from slipstream.models.config import VisionConfig
from slipstream.models.image_processor import HALF, pixel_fields, preprocessor_config, rescale_normalize, to_rgb

PROCESSORS = tuple(f"{name}{suffix}" for name in ("Idefics3ImageProcessor", "SmolVLMImageProcessor")
                   for suffix in ("", "Fast", "Pil"))
MAX_IMAGE_SIZE = 4096  # transformers' bound on a resized image's longest edge


@dataclasses.dataclass(frozen=True)
class Tiles:
    """An image as the tower takes it: its tiles row by row, then the global image; rows x cols of split tiles (0, 0:
    the global image alone)."""

    pixels: np.ndarray  # f32[rows * cols + 1 (or 1), 3, M, M]
    rows: int
    cols: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Idefics3ImageProcessor:
    """One processor's settings (transformers' field names and meanings)."""

    longest_edge: int                  # size["longest_edge"]: the first resize's longest edge
    tile: int                          # max_image_size["longest_edge"]: a tile's side, the tower's image_size
    do_resize: bool = True
    do_image_splitting: bool = True
    resample: int = Image.Resampling.LANCZOS
    rescale_factor: float | None = 1 / 255
    mean: tuple[float, ...] | None = HALF
    std: tuple[float, ...] | None = HALF
    do_convert_rgb: bool = True

    def __post_init__(self) -> None:
        if self.longest_edge < 1 or self.tile < 1:
            raise ValueError(f"image processor size and max_image_size must be positive, got {self.longest_edge} "
                             f"and {self.tile}")

    @classmethod
    def from_dict(cls, raw: dict) -> "Idefics3ImageProcessor":
        kind = raw.get("image_processor_type", "Idefics3ImageProcessor")
        if kind not in PROCESSORS:
            raise ValueError(f"image processor {kind!r} is not supported for Idefics3; supported: "
                             f"{', '.join(PROCESSORS)}")
        tile = int((raw.get("max_image_size") or {}).get("longest_edge", 364))
        size = raw.get("size") or {"longest_edge": 4 * 364}
        if "longest_edge" not in size:
            raise ValueError(f"image processor size {size} is not supported: Idefics3's is {{'longest_edge': N}}")
        return cls(longest_edge=int(size["longest_edge"]), tile=tile, do_resize=bool(raw.get("do_resize", True)),
                   do_image_splitting=bool(raw.get("do_image_splitting", True)),
                   resample=int(raw.get("resample", Image.Resampling.LANCZOS)),
                   **pixel_fields(raw, HALF, HALF))

    @classmethod
    def for_model(cls, folder: str | None, vision: VisionConfig) -> "Idefics3ImageProcessor":
        """The directory's preprocessor_config.json; without one (a preset's dummy weights), transformers' defaults
        at the tower's image size (tiles of image_size, the longest edge 4 tiles)."""
        if (raw := preprocessor_config(folder)) is not None:
            return cls.from_dict(raw)
        return cls(longest_edge=4 * vision.image_size, tile=vision.image_size)

    def __call__(self, image: Image.Image) -> Tiles:
        """An image -> its tiles, in transformers' order: resize, split (or resize to one tile), rescale, normalize."""
        if self.do_convert_rgb:
            image = to_rgb(image)
        if self.do_resize:
            image = self._resize(image, _longest_edge(image.height, image.width, self.longest_edge))
        m = self.tile
        rows = cols = 0
        if not self.do_image_splitting:
            frames = [self._resize(image, (m, m))]
        else:
            image = self._resize(image, _tile_multiple(image.height, image.width, m))
            frames = [image]
            if image.height > m or image.width > m:
                rows, cols = image.height // m, image.width // m
                frames = [image.crop((c * m, r * m, (c + 1) * m, (r + 1) * m)) for r in range(rows)
                          for c in range(cols)]
                frames.append(self._resize(image, (m, m)))
        tiles = [rescale_normalize(np.asarray(f).transpose(2, 0, 1), self.rescale_factor, self.mean, self.std)
                 for f in frames]
        return Tiles(np.stack(tiles), rows, cols)

    def _resize(self, image: Image.Image, size: tuple[int, int]) -> Image.Image:
        return image.resize(size[::-1], resample=self.resample)


def _longest_edge(height: int, width: int, longest: int) -> tuple[int, int]:
    """(height, width) with the longest edge `longest` (up or down), the other even and in proportion, both within
    MAX_IMAGE_SIZE (transformers' _resize_output_size_rescale_to_max_len, then _scale_below_upper_bound)."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def _tile_multiple(height: int, width: int, m: int) -> tuple[int, int]:
    """Both edges rounded up to multiples of the tile (transformers' resize_for_vision_encoder)."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / m) * m
        height = math.ceil(int(width / aspect) / m) * m
    else:
        height = math.ceil(height / m) * m
        width = math.ceil(int(height * aspect) / m) * m
    return height, width


def image_prompt(rows: int, cols: int, image_seq_len: int) -> str:
    """The text that replaces an image's <image> in the prompt (Idefics3Processor's): per tile a
    <fake_token_around_image>, its <row_r_col_c> and image_seq_len <image>, a newline after each row of tiles, then
    the global image's run between <fake_token_around_image>s."""
    fake, image = "<fake_token_around_image>", "<image>"
    text = ""
    for r in range(rows):
        text += "".join(f"{fake}<row_{r + 1}_col_{c + 1}>" + image * image_seq_len for c in range(cols)) + "\n"
    return text + ("\n" if rows else "") + f"{fake}<global-img>" + image * image_seq_len + fake
