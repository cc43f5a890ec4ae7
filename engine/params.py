"""Model params as the engine runs them: quantized (with calibration) and cast to the activation dtype.
Load time only; no step code here."""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from quantization import QuantizedWeight, quantize


def prepare_params(params: dict, model_cfg: ModelConfig, mode: str, dtype, *, progress: bool = False,
                   calibration_tokens: Sequence[int] | None = None) -> dict:
    """Quantize (from the float weights) and cast the remaining float leaves to the activation dtype.

    calibration_tokens (the model's tokenization of models.calibration.calibration_text()) lets the
    per-channel int8 modes (w8a16, w8a8) fold SmoothQuant factors into the float weights first; without
    them they round the weights as they are, with a warning.
    q8_0 and q8_0-a16 (group-wise int8) need no calibration; weights the loader already built
    (models.loader with quantize="q8_0") are kept as they are, so their floats never exist.
    """
    if mode in ("q8_0", "q8_0-a16"):
        if "lm_head" not in params:  # tied: int8 rows straight from the embedding table ([vocab, hidden])
            import numpy as np

            from quantization.groupwise import pack_one, quantize_rows

            params = {**params, "lm_head": pack_one(quantize_rows(np.asarray(params["embed"], np.float32)), mode)}
        params = quantize(params, mode, include_embeddings=True, progress=progress)
    elif mode != "none":
        keep_a16: dict = {}
        if calibration_tokens is not None:
            from models.calibration import calibrate  # load time only

            params, keep_a16 = calibrate(params, model_cfg, mode, calibration_tokens)
        else:
            import warnings

            warnings.warn(f"{mode} without calibration_tokens: activation outliers are not smoothed "
                          "(expect a larger accuracy loss; see models/calibration.py)", stacklevel=2)
        if "lm_head" not in params:  # tied: an int8 copy for the LM head, the float table stays for lookups
            params = {**params, "lm_head": params["embed"].T}
        params = quantize(params, mode, include_embeddings=True, progress=progress, keep_a16=keep_a16)

    def cast(x):
        if isinstance(x, QuantizedWeight) or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return x.astype(dtype)

    return jax.tree.map(cast, params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
