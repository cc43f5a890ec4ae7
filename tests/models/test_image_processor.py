"""Image preprocessing against transformers' processors (CLIP's shortest-edge resize and center crop, SigLIP's fixed
resize) on images of several sizes and modes, and decoding's refusals."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from slipstream.models.image_processor import ImageError, ImageProcessor, decode_image

CLIP = {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 32}, "resample": 3,
        "do_center_crop": True, "crop_size": {"height": 32, "width": 32}, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "do_convert_rgb": True}
SIGLIP = {"image_processor_type": "SiglipImageProcessor", "size": {"height": 24, "width": 24}, "resample": 2,
          "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
          "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True}


def _images():
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (50, 77, 3), np.uint8))                 # wide: resize then crop
    tall = Image.fromarray(rng.integers(0, 256, (90, 41, 3), np.uint8))
    small = Image.fromarray(rng.integers(0, 256, (20, 30, 4), np.uint8), "RGBA")       # transparency; crop pads
    gray = Image.fromarray(rng.integers(0, 256, (64, 48), np.uint8), "L")
    return [rgb, tall, small, gray]


@pytest.mark.parametrize("raw", [CLIP, SIGLIP], ids=["clip", "siglip"])
def test_pixels_match_transformers(raw):
    import transformers

    ours = ImageProcessor.from_dict(raw)
    cls = (transformers.CLIPImageProcessor if raw is CLIP else transformers.SiglipImageProcessor)
    theirs = cls(**{k: v for k, v in raw.items() if k != "image_processor_type"})
    for image in _images():
        want = theirs(images=[image], return_tensors="np")["pixel_values"][0]
        got = ours(image)
        assert got.shape == want.shape and got.dtype == np.float32
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


def test_decode_reads_png_and_refuses_what_is_not_an_image():
    buf = io.BytesIO()
    Image.new("RGB", (7, 5), (1, 2, 3)).save(buf, "PNG")
    assert decode_image(buf.getvalue()).size == (7, 5)
    with pytest.raises(ImageError, match="not a decodable image"):
        decode_image(b"definitely not a png")
    with pytest.raises(ImageError, match="not a decodable image"):
        decode_image(buf.getvalue()[:30])  # truncated
    with pytest.raises(ImageError, match="more than 34 pixels"):
        decode_image(buf.getvalue(), max_pixels=34)
