"""Calibration pass for int8 weights: per-channel statistics of every linear's input on a short
shipped text, and the smoothing they drive. The pass is a pure function of (params, cfg, tokens)
built from models/layers.py; the params math lives in quantization/, which never imports this.
"""
from __future__ import annotations

import functools
import importlib.resources

import jax
import jax.numpy as jnp
import numpy as np

from models import layers
from models.config import ModelConfig
from quantization.smoothing import INPUTS, MODE_ALPHA, search_alpha, smooth

_INPUT_OF = {names[0]: name for name, names in INPUTS}
# Calibration rows the w8a8 alpha search rounds through each layer (its cost is linear in them).
SEARCH_ROWS = 256
# w8a8 keeps this share of the layers' w_down at w8a16 (at least one): 3 of SmolLM2-135M's 30, 1.4%
# of its 211 linears.
KEEP_A16_SHARE = 0.1


def calibration_text() -> str:
    """The shipped calibration text (varied English prose, a little code and chat; not eval data)."""
    return importlib.resources.files("quantization").joinpath("data/calibration.txt").read_text("utf-8")


@functools.partial(jax.jit, static_argnames=("cfg", "gram", "samples"))
def activation_stats(params: dict, cfg: ModelConfig, tokens: jax.Array, *, gram: bool = False,
                     samples: int = 0) -> dict:
    """Statistics of each linear's input over tokens int32 [B,T] (every token valid, causal).

    Returns {name: max |x| per channel} for the names in INPUTS, each [L, channels], and "final"
    [D] (the LM head's input, after the final norm). With gram, also {name + "_gram": sum over
    tokens of x x^T} ([L, C, C]; "final_gram" [D, D]), what error-compensating rounding needs.
    params["layers"] must be stacked [L, ...] leaves of float weights.
    """
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = jnp.broadcast_to(positions[:, None, :] <= positions[:, :, None], (b, t, t))    # [B,T,T]
    if cfg.sliding_window is not None:
        mask = mask & (positions[:, None, :] > positions[:, :, None] - cfg.sliding_window)
    inv_freq = jnp.asarray(layers.rope_inv_freq(cfg))

    def stats(x: jax.Array, name: str) -> dict:
        x = x.astype(jnp.float32).reshape(-1, x.shape[-1])                              # [B*T,C]
        out = {name: jnp.max(jnp.abs(x), axis=0)}                                        # [C]
        if gram:
            out[name + "_gram"] = jnp.einsum("ni,nj->ij", x, x)                          # [C,C]
        if samples:
            out[name + "_x"] = x[jnp.linspace(0, x.shape[0] - 1, samples).astype(jnp.int32)]  # [S,C]
        return out

    def layer(x, lp):
        seen: dict = {}
        plain = layers.layer_matmul(lp)

        def matmul(a, names):  # the forward's own matmuls, recording what each group reads
            seen.update(stats(a, _INPUT_OF[names[0]]))
            return plain(a, names)

        h = layers.rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        q, k, v = layers.qkv(h, lp, cfg, positions, inv_freq, matmul=matmul)
        x = x + matmul(layers.attend(q, k, v, mask), ("wo",))[0]
        x = x + layers.swiglu(layers.rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), lp, matmul=matmul)
        return x, seen

    x = jnp.take(params["embed"], tokens, axis=0).astype(jnp.float32)                   # [B,T,D]
    x, per_layer = jax.lax.scan(layer, x, params["layers"])
    final = stats(layers.rms_norm(x, params["final_norm"], cfg.rms_norm_eps), "final")
    return {**per_layer, **final}


def smooth_for_mode(params: dict, cfg: ModelConfig, mode: str, tokens) -> dict:
    """params with the smoothing factors for int8 `mode` folded in, calibrated on `tokens` ([T] ids,
    e.g. the model's tokenization of calibration_text()). Still float: quantize afterwards."""
    return calibrate(params, cfg, mode, tokens)[0]


def outlier_layers(mlp_hidden_max: np.ndarray, count: int) -> np.ndarray:
    """bool [L]: the `count` layers whose MLP hidden state has the largest max / median channel
    maximum, the w_down inputs int8 rows cannot hold even after smoothing."""
    m = np.asarray(mlp_hidden_max, np.float64)                                           # [L, F]
    ratio = m.max(-1) / np.maximum(np.median(m, -1), 1e-12)
    keep = np.zeros(m.shape[0], bool)
    keep[np.argsort(-ratio)[:count]] = True
    return keep


def calibrate(params: dict, cfg: ModelConfig, mode: str, tokens) -> tuple[dict, dict]:
    """(smoothed params as smooth_for_mode returns them, keep_a16 for quantization.quantize:
    the w8a8 layer weights left at w8a16)."""
    if mode not in MODE_ALPHA:
        raise ValueError(f"no smoothing for mode {mode!r}; int8 modes: {', '.join(MODE_ALPHA)}")
    ids = np.asarray(tokens, np.int64).reshape(-1)
    if ids.size < 2 or ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(f"calibration needs >= 2 token ids in [0, {cfg.vocab_size}); got {ids.size} ids"
                         + (f" in [{ids.min()}, {ids.max()}]" if ids.size else ""))
    # w8a8 picks each layer's migration strength by its own rounding error on a sample of rows
    samples = min(SEARCH_ROWS, ids.size) if mode == "w8a8" else 0
    stats = activation_stats(params, cfg, jnp.asarray(ids, jnp.int32)[None], samples=samples)
    alpha = MODE_ALPHA[mode]
    if samples:
        alpha = search_alpha(params["layers"], stats, {name: stats[name + "_x"] for name, _ in INPUTS},
                             num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads)
    smoothed, _ = smooth(params, stats, alpha=alpha, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads)
    keep = {}
    if mode == "w8a8":
        keep["w_down"] = outlier_layers(jax.device_get(stats["mlp_hidden"]),
                                        max(1, round(KEEP_A16_SHARE * cfg.num_layers)))
    return smoothed, keep
