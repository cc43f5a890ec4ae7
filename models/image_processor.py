"""Image preprocessing as a model directory's preprocessor_config.json says (transformers' CLIPImageProcessor and
SiglipImageProcessor: RGB conversion, resize with the same resampling filter, center crop, rescale, normalize), with
Pillow: an image in, the vision tower's pixels f32[3, H, W] out. Decoding refuses what is not an image or is too
large before its pixels are read."""
from __future__ import annotations

import dataclasses
import io
import json
import os

import numpy as np
from PIL import Image, UnidentifiedImageError

from slipstream.models.config import VisionConfig

# transformers' OPENAI_CLIP_MEAN / _STD (CLIP's defaults) and SigLIP's
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)
PROCESSORS = ("CLIPImageProcessor", "CLIPImageProcessorFast", "SiglipImageProcessor", "SiglipImageProcessorFast")
MAX_PIXELS = 64 * 1024 * 1024  # an image's width x height, checked from its header before decoding (a pixel bomb)


class ImageError(ValueError):
    """Bytes that are not a decodable image of an accepted size."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageProcessor:
    """One processor's settings (transformers' field names and meanings)."""

    size: tuple[int, int] | int        # (height, width), or the shortest edge's length (aspect ratio kept)
    resample: int = Image.Resampling.BICUBIC
    do_resize: bool = True
    crop_size: tuple[int, int] | None = None  # (height, width) of the center crop; None: no crop
    rescale_factor: float | None = 1 / 255
    mean: tuple[float, ...] | None = CLIP_MEAN  # None: no normalization
    std: tuple[float, ...] | None = CLIP_STD
    do_convert_rgb: bool = True

    @classmethod
    def from_dict(cls, raw: dict) -> "ImageProcessor":
        kind = raw.get("image_processor_type", "CLIPImageProcessor")
        if kind not in PROCESSORS:
            raise ValueError(f"image processor {kind!r} is not supported; supported: {', '.join(PROCESSORS)}")
        siglip = kind.startswith("Siglip")
        size = raw.get("size") or ({"height": 224, "width": 224} if siglip else {"shortest_edge": 224})
        if isinstance(size, int):
            size = {"shortest_edge": size} if not siglip else {"height": size, "width": size}
        if "shortest_edge" in size:
            out_size: tuple[int, int] | int = int(size["shortest_edge"])
        else:
            out_size = (int(size["height"]), int(size["width"]))
        crop = raw.get("crop_size") or {"height": 224, "width": 224}
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        do_crop = raw.get("do_center_crop", not siglip)
        default_mean, default_std = (HALF, HALF) if siglip else (CLIP_MEAN, CLIP_STD)
        return cls(size=out_size,
                   resample=int(raw.get("resample", Image.Resampling.BILINEAR if siglip else Image.Resampling.BICUBIC)),
                   do_resize=bool(raw.get("do_resize", True)),
                   crop_size=(int(crop["height"]), int(crop["width"])) if do_crop else None,
                   **pixel_fields(raw, default_mean, default_std))

    @classmethod
    def for_model(cls, folder: str | None, vision: VisionConfig) -> "ImageProcessor":
        """The directory's preprocessor_config.json; without one (an architecture preset's dummy weights), the
        tower's own defaults at its image size."""
        if (raw := preprocessor_config(folder)) is not None:
            return cls.from_dict(raw)
        n = vision.image_size
        if vision.kind == "siglip":
            return cls(size=(n, n), resample=Image.Resampling.BILINEAR, mean=HALF, std=HALF)
        return cls(size=n, crop_size=(n, n))

    @property
    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every output, or None where it follows the input's aspect ratio."""
        if self.crop_size is not None:
            return self.crop_size
        return self.size if self.do_resize and not isinstance(self.size, int) else None

    def __call__(self, image: Image.Image) -> np.ndarray:
        """An image -> pixels f32[3, H, W], in transformers' order: resize, center crop, rescale, normalize."""
        if self.do_convert_rgb:
            image = to_rgb(image)
        if self.do_resize:
            image = image.resize(self._resized(image.height, image.width)[::-1], resample=self.resample)
        x = np.asarray(image)                                                      # [H,W,3] uint8
        if x.ndim == 2:
            x = x[..., None]
        x = x.transpose(2, 0, 1)                                                   # [3,H,W]
        if self.crop_size is not None:
            x = center_crop(x, *self.crop_size)
        return rescale_normalize(x, self.rescale_factor, self.mean, self.std)

    def _resized(self, height: int, width: int) -> tuple[int, int]:
        if not isinstance(self.size, int):
            return self.size
        short, long = (width, height) if width <= height else (height, width)
        new_long = int(self.size * long / short)
        return (new_long, self.size) if width <= height else (self.size, new_long)


def preprocessor_config(folder: str | None) -> dict | None:
    """The model directory's preprocessor_config.json, or None where it has none (a preset's dummy weights)."""
    path = None if folder is None else os.path.join(folder, "preprocessor_config.json")
    if path is None or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def pixel_fields(raw: dict, default_mean: tuple[float, ...], default_std: tuple[float, ...]) -> dict:
    """A preprocessor_config.json's rescale, normalize and RGB fields, as every transformers image processor reads
    them."""
    normalize = raw.get("do_normalize", True)
    return dict(rescale_factor=float(raw.get("rescale_factor", 1 / 255)) if raw.get("do_rescale", True) else None,
                mean=tuple(raw.get("image_mean") or default_mean) if normalize else None,
                std=tuple(raw.get("image_std") or default_std) if normalize else None,
                do_convert_rgb=bool(raw.get("do_convert_rgb", True)))


def rescale_normalize(x: np.ndarray, factor: float | None, mean: tuple[float, ...] | None,
                      std: tuple[float, ...] | None) -> np.ndarray:
    """x [3, H, W] (uint8) -> f32, rescaled (in f64, as transformers does) then normalized per channel in f32."""
    if factor is not None:
        x = (x.astype(np.float64) * factor).astype(np.float32)
    x = x.astype(np.float32)
    if mean is not None:
        x = (x - np.asarray(mean, np.float32)[:, None, None]) / np.asarray(std, np.float32)[:, None, None]
    return np.ascontiguousarray(x, np.float32)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, transparency composited onto white (as transformers does)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")


def center_crop(x: np.ndarray, height: int, width: int) -> np.ndarray:
    """x [C, H, W] cropped to the center (height, width), zero-padded where it is smaller (as transformers does)."""
    _, h, w = x.shape
    if h < height or w < width:
        padded = np.zeros((x.shape[0], max(h, height), max(w, width)), x.dtype)
        top, left = -(-(padded.shape[1] - h) // 2), -(-(padded.shape[2] - w) // 2)
        padded[:, top:top + h, left:left + w] = x
        x, h, w = padded, padded.shape[1], padded.shape[2]
    top, left = (h - height) // 2, (w - width) // 2
    return x[:, top:top + height, left:left + width]


def decode_image(data: bytes, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """Image bytes (PNG, JPEG, WebP, GIF's first frame...) -> a loaded Pillow image; ImageError if they are not an image
    or it has more than max_pixels pixels (checked from the header, before the pixels are decoded)."""
    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > max_pixels:
            raise ImageError(f"the image is {image.width}x{image.height}, more than {max_pixels} pixels")
        image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        if isinstance(e, ImageError):
            raise
        raise ImageError(f"not a decodable image ({type(e).__name__}: {e})") from None
    return image
