"""Idefics3's image preprocessing and prompt layout against transformers': the tiles' pixels (image splitting on and
off, landscape, portrait, small and transparent images), their grid, and the text that replaces <image>."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from slipstream.models.idefics3_processor import Idefics3ImageProcessor, image_prompt

CONFIG = {"image_processor_type": "Idefics3ImageProcessor", "do_convert_rgb": True, "do_image_splitting": True,
          "do_normalize": True, "do_pad": True, "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
          "image_std": [0.5, 0.5, 0.5], "max_image_size": {"longest_edge": 32}, "resample": 1,
          "rescale_factor": 1 / 255, "size": {"longest_edge": 96}}


def _image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[:height, :width]
    pixels = (rng.integers(0, 256, 4) + 7 * x[..., None] + 3 * y[..., None] + rng.integers(0, 40, (height, width, 4)))
    return Image.fromarray((pixels % 256).astype(np.uint8), "RGBA").convert(mode)


def _transformers(config: dict, image: Image.Image):
    import transformers

    hf = transformers.Idefics3ImageProcessorPil(**{k: v for k, v in config.items() if k != "image_processor_type"})
    out = hf(images=[[image]], return_tensors="np", return_row_col_info=True)
    return out["pixel_values"][0], out["rows"][0][0], out["cols"][0][0]


@pytest.mark.parametrize("size, mode", [((70, 40), "RGB"), ((40, 90), "RGB"), ((20, 20), "RGB"), ((96, 96), "RGB"),
                                        ((33, 61), "RGBA"), ((500, 13), "L")])
@pytest.mark.parametrize("splitting", [True, False])
def test_tiles_equal_transformers(size, mode, splitting):
    config = {**CONFIG, "do_image_splitting": splitting}
    image = _image(*size, mode)
    ref, rows, cols = _transformers(config, image)
    ours = Idefics3ImageProcessor.from_dict(config)(image)
    assert (ours.rows, ours.cols) == (rows, cols)
    assert ours.pixels.shape == ref.shape
    assert len(ref) == (rows * cols + 1 if rows else 1) and (rows > 0) == splitting
    np.testing.assert_allclose(ours.pixels, ref, atol=1e-6, rtol=0)


def test_no_resize_keeps_a_tile_sized_image_whole():
    config = {**CONFIG, "do_resize": False}
    image = _image(32, 20)
    ref, rows, cols = _transformers(config, image)
    ours = Idefics3ImageProcessor.from_dict(config)(image)
    assert (ours.rows, ours.cols, ours.pixels.shape) == (0, 0, (1, 3, 32, 32)) == (rows, cols, ref.shape)
    np.testing.assert_allclose(ours.pixels, ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("rows, cols", [(0, 0), (1, 2), (3, 1), (2, 2)])
def test_prompt_equals_transformers(rows, cols):
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    assert image_prompt(rows, cols, 5) == get_image_prompt_string(rows, cols, 5, "<fake_token_around_image>",
                                                                  "<image>", "<global-img>")


def test_refuses_another_processor():
    with pytest.raises(ValueError, match="image processor 'CLIPImageProcessor' is not supported for Idefics3"):
        Idefics3ImageProcessor.from_dict({**CONFIG, "image_processor_type": "CLIPImageProcessor"})
