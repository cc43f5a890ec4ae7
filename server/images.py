"""Image inputs for a vision-language model: an image part's source (a data URL, an http(s) URL the server fetches,
or base64 bytes) read and checked against the limits, preprocessed as the model's processor says, and the rendered
prompt's placeholder tokens expanded to the rows each image fills (as transformers' LlavaProcessor does). Every
refusal is a 400 naming the request field. CPU only; runs on the worker thread that prepares a request."""
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

    pixels: np.ndarray  # f32[3, H, W]
    param: str


class ImageInputs:
    """What a vision-language model's requests need from the front ends."""

    def __init__(self, processor: ImageProcessor, image_token_id: int, rows: int, limits: ImageLimits) -> None:
        self.processor = processor
        self.image_token_id = image_token_id
        self.rows = rows  # prompt positions an image fills
        self.limits = limits

    @classmethod
    def for_model(cls, cfg: ModelConfig, folder: str | None, limits: ImageLimits) -> "ImageInputs | None":
        """None for a text-only model."""
        if cfg.vision is None:
            return None
        processor = ImageProcessor.for_model(folder, cfg.vision)
        size = cfg.vision.image_size
        if processor.output_size != (size, size):
            raise ValueError(f"{folder}: preprocessor_config.json makes images of {processor.output_size or 'varying'} "
                             f"pixels (height, width); the vision tower takes {size}x{size}")
        return cls(processor, cfg.image_token_id, cfg.vision.num_image_tokens, limits)

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
        """The rendered prompt with each image placeholder repeated for its image's rows, and the images' runs."""
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
            digest = hashlib.blake2b(np.asarray(image.pixels.shape, np.int64).tobytes(), digest_size=16)
            digest.update(image.pixels.tobytes())
            inputs.append(ImageInput(image.pixels, len(out), self.rows, digest.digest()))
            out += [self.image_token_id] * self.rows
            last = where + 1
        return out + ids[last:], tuple(inputs)

    def _decoded(self, data: bytes, param: str) -> LoadedImage:
        if len(data) > self.limits.max_image_bytes:
            raise self._too_large(param)
        try:
            image = decode_image(data)
        except ImageError as exc:
            raise ServiceError(400, f"{param}: {exc}", param=param, code="invalid_value") from None
        return LoadedImage(self.processor(image), param)

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
