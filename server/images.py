"""Image inputs for a vision-language model: an image part's source (a data URL, an http(s) URL the server fetches,
or base64 bytes) read and checked against the limits, preprocessed as the model's processor says, and the rendered
prompt's placeholder tokens expanded to the rows each image fills (as transformers' LlavaProcessor does; Idefics3's
processor writes each tile's rows between text tokens, and each tile is an ImageInput of its own). Every refusal is a
400 naming the request field. CPU only; runs on the worker thread that prepares a request."""
from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import urllib.error
import urllib.request
from typing import Any

import numpy as np

from slipstream.engine.request import ImageInput
from slipstream.models.config import ModelConfig
from slipstream.models.idefics3_processor import Idefics3ImageProcessor, image_prompt
from slipstream.models.image_processor import ImageError, ImageProcessor, decode_image
from slipstream.server.errors import ServiceError

DEFAULT_MAX_IMAGES = 8
DEFAULT_MAX_IMAGE_BYTES = 20 << 20
DEFAULT_FETCH_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageLimits:
    max_images: int = DEFAULT_MAX_IMAGES           # per request (--max-images-per-request)
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # one image's encoded bytes (--max-image-bytes)
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S  # an http(s) URL's connect, and each read (--image-fetch-timeout)
    fetch_urls: bool = True                          # http(s) URLs allowed (--no-image-urls: data URLs only)

    def __post_init__(self) -> None:
        if self.max_images < 1 or self.max_image_bytes < 1 or not self.fetch_timeout_s > 0:
            raise ValueError("image limits must be positive: max_images, max_image_bytes, fetch_timeout_s")


@dataclasses.dataclass(frozen=True)
class LoadedImage:
    """An image part read and preprocessed: the tower's pixels and the field it came from."""

    tiles: np.ndarray           # f32[n, 3, H, W]: one tower input per run of rows (LLaVA: 1; Idefics3: its tiles)
    param: str
    grid: tuple[int, int] = (0, 0)  # Idefics3's rows x columns of split tiles ((0, 0): the global image alone)


class TileLayout:
    """Idefics3Processor's text in place of an image's <image> (models/idefics3_processor.image_prompt), tokenized as
    transformers tokenizes it, and where each tile's run of image tokens starts in it."""

    def __init__(self, tokenizer: Any, image_token_id: int, rows: int) -> None:
        if tokenizer.encode("<image>", add_special_tokens=False) != [image_token_id]:
            raise ValueError(f"the tokenizer does not read <image> as the model's image token {image_token_id}")
        self._tokenizer, self._image, self._rows = tokenizer, image_token_id, rows
        self._cache: dict[tuple[int, int], tuple[list[int], list[int]]] = {}

    def __call__(self, grid: tuple[int, int]) -> tuple[list[int], list[int]]:
        """(rows, cols) of tiles -> the replacement's ids and each tile's first position in them."""
        if grid not in self._cache:
            ids = self._tokenizer.encode(image_prompt(*grid, self._rows), add_special_tokens=False)
            starts = [i for i, t in enumerate(ids) if t == self._image and (i == 0 or ids[i - 1] != self._image)]
            if len(starts) != grid[0] * grid[1] + 1 or ids.count(self._image) != self._rows * len(starts):
                raise ValueError(f"the tokenizer splits Idefics3's image prompt for {grid} tiles into "
                                 f"{len(starts)} image runs, not one of {self._rows} per tile")
            self._cache[grid] = (ids, starts)
        return self._cache[grid]


class ImageInputs:
    """What a vision-language model's requests need from the front ends."""

    def __init__(self, processor: ImageProcessor | Idefics3ImageProcessor, image_token_id: int, rows: int,
                 limits: ImageLimits, tiles: TileLayout | None = None) -> None:
        self.processor = processor
        self.image_token_id = image_token_id
        self.rows = rows  # prompt positions an image (a tile) fills
        self.limits = limits
        self.tiles = tiles  # Idefics3's layout of an image's tiles in the prompt; None: one run of `rows`

    @classmethod
    def for_model(cls, cfg: ModelConfig, folder: str | None, limits: ImageLimits,
                  tokenizer: Any = None) -> "ImageInputs | None":
        """None for a text-only model. Idefics3 needs the tokenizer: its processor writes text between the tiles."""
        if cfg.vision is None:
            return None
        size, rows = cfg.vision.image_size, cfg.vision.num_image_tokens
        if cfg.architecture == "idefics3":
            if tokenizer is None:
                raise ValueError("an Idefics3 model's image inputs need its tokenizer (the text around its tiles)")
            processor = Idefics3ImageProcessor.for_model(folder, cfg.vision)
            if processor.tile != size:
                raise ValueError(f"{folder}: preprocessor_config.json's max_image_size makes tiles of "
                                 f"{processor.tile}x{processor.tile} pixels; the vision tower takes {size}x{size}")
            return cls(processor, cfg.image_token_id, rows, limits, TileLayout(tokenizer, cfg.image_token_id, rows))
        processor = ImageProcessor.for_model(folder, cfg.vision)
        if processor.output_size != (size, size):
            raise ValueError(f"{folder}: preprocessor_config.json makes images of {processor.output_size or 'varying'} "
                             f"pixels (height, width); the vision tower takes {size}x{size}")
        return cls(processor, cfg.image_token_id, rows, limits)

    def check_count(self, count: int, param: str) -> None:
        """Before reading the count-th image (1-based) of a request."""
        if count > self.limits.max_images:
            raise ServiceError(400, f"{param}: more than {self.limits.max_images} images in one request (this "
                               "server's --max-images-per-request)", param=param, code="invalid_value")

    def from_url(self, url: Any, param: str) -> LoadedImage:
        """An image_url's url: a data URL (base64) or an http(s) URL, fetched."""
        if not isinstance(url, str) or not url:
            raise ServiceError(400, f"{param} must be a data: or http(s) URL string", param=param,
                               code="invalid_value")
        if url.startswith("data:"):
            header, comma, payload = url.partition(",")
            if not comma or not header.endswith(";base64"):
                raise ServiceError(400, f"{param}: a data URL must be base64 (data:image/png;base64,...)",
                                   param=param, code="invalid_value")
            return self.from_base64(payload, param)
        if url.startswith(("http://", "https://")):
            if not self.limits.fetch_urls:
                raise ServiceError(400, f"{param}: this server takes images as data URLs only (--no-image-urls)",
                                   param=param, code="unsupported")
            return self._decoded(self._fetch(url, param), param)
        raise ServiceError(400, f"{param} must be a data: or http(s) URL, got {url[:40]!r}", param=param,
                           code="invalid_value")

    def from_base64(self, payload: Any, param: str) -> LoadedImage:
        if not isinstance(payload, str):
            raise ServiceError(400, f"{param} must be a base64 string", param=param, code="invalid_value")
        if len(payload) > 4 * (self.limits.max_image_bytes // 3 + 1):  # before decoding it
            raise self._too_large(param)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ServiceError(400, f"{param}: not valid base64", param=param, code="invalid_value") from None
        return self._decoded(data, param)

    def expand(self, ids: list[int], images: list[LoadedImage], param: str) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The rendered prompt with each image placeholder replaced by its image's rows (and, for Idefics3, the text
        around its tiles), and each tile's run."""
        at = [i for i, token in enumerate(ids) if token == self.image_token_id]
        if len(at) != len(images):
            raise ServiceError(400, f"the prompt holds {len(at)} image placeholders for {len(images)} images (the "
                               "chat template renders one per image part; text must not contain the image token)",
                               param=param, code="invalid_value")
        out: list[int] = []
        inputs = []
        last = 0
        for where, image in zip(at, images):
            out += ids[last:where]
            replacement, starts = ([self.image_token_id] * self.rows, [0]) if self.tiles is None else (
                self.tiles(image.grid))
            for tile, start in zip(image.tiles, starts, strict=True):
                digest = hashlib.blake2b(np.asarray(tile.shape, np.int64).tobytes(), digest_size=16)
                digest.update(tile.tobytes())
                inputs.append(ImageInput(tile, len(out) + start, self.rows, digest.digest()))
            out += replacement
            last = where + 1
        return out + ids[last:], tuple(inputs)

    def _decoded(self, data: bytes, param: str) -> LoadedImage:
        if len(data) > self.limits.max_image_bytes:
            raise self._too_large(param)
        try:
            image = decode_image(data)
        except ImageError as exc:
            raise ServiceError(400, f"{param}: {exc}", param=param, code="invalid_value") from None
        if self.tiles is None:
            return LoadedImage(self.processor(image)[None], param)
        tiles = self.processor(image)
        return LoadedImage(tiles.pixels, param, (tiles.rows, tiles.cols))

    def _too_large(self, param: str) -> ServiceError:
        return ServiceError(400, f"{param}: the image is larger than {self.limits.max_image_bytes} bytes (this "
                            "server's --max-image-bytes)", param=param, code="invalid_value")

    def _fetch(self, url: str, param: str) -> bytes:
        limit = self.limits.max_image_bytes
        request = urllib.request.Request(url, headers={"User-Agent": "slipstream"})
        try:
            with urllib.request.urlopen(request, timeout=self.limits.fetch_timeout_s) as response:
                length = response.headers.get("Content-Length")
                if length is not None and length.isdigit() and int(length) > limit:
                    raise self._too_large(param)
                data = response.read(limit + 1)
        except urllib.error.HTTPError as exc:
            raise ServiceError(400, f"{param}: fetching the image failed: HTTP {exc.code}", param=param,
                               code="invalid_value") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ServiceError(400, f"{param}: fetching the image failed ({reason}; timeout "
                               f"{self.limits.fetch_timeout_s:g} s)", param=param, code="invalid_value") from None
        if len(data) > limit:
            raise self._too_large(param)
        return data
