"""SmoothQuant for w8a8: move activation outliers into the weights, folded exactly into params.

Each linear input x is divided per channel by s and the weight rows that read it are multiplied by
s, inside ops the forward already has (norm weights, V and up projections), so the float model is
unchanged and the forward code does not know. Needs per-channel max |x| from a calibration pass.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from quantization.weights import INT8_MAX

# Each input group: (name, the weights that read it). Names match models/calibration.py's stats.
INPUTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attn_in", ("wq", "wk", "wv")),
    ("attn_out", ("wo",)),
    ("mlp_in", ("w_gate", "w_up")),
    ("mlp_hidden", ("w_down",)),
)
DEFAULT_ALPHA = 0.5
# Migration strength per int8 mode, chosen by KL to f32 on the calibration text (never the eval
# text). w8a8 wants most of the outliers moved into the weights, except from the MLP hidden state,
# whose rare huge activations would then swamp whole weight columns; w8a16 has no activation
# rounding and gains only from the weights' salient rows getting finer steps (as in AWQ).
MODE_ALPHA: dict[str, dict[str, float]] = {
    "w8a8": {"attn_in": 0.7, "attn_out": 0.8, "mlp_in": 0.7, "mlp_hidden": 0.5},
    "w8a16": {"attn_in": 0.4, "attn_out": 0.4, "mlp_in": 0.4, "mlp_hidden": 0.4},
}
_MIN_SCALE = 1e-5
# Candidates for search_alpha; 0 (no migration) lets a layer without outliers opt out.
ALPHA_GRID: tuple[float, ...] = (0.0, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
Alpha = float | Mapping[str, float | np.ndarray | jax.Array]


def _factors(act_max: jax.Array, weight_max: jax.Array, alpha) -> jax.Array:
    """s = max|x|^alpha / max|w|^(1 - alpha) per channel; 1 where a channel never fires.

    act_max, weight_max [L, ...channels]; alpha a float or one per layer [L]."""
    a = act_max.astype(jnp.float32)
    alpha = jnp.asarray(alpha, jnp.float32).reshape((-1,) + (1,) * (a.ndim - 1))  # [L or 1, 1...]
    w = jnp.maximum(weight_max.astype(jnp.float32), _MIN_SCALE)
    s = a**alpha / w ** (1.0 - alpha)
    return jnp.where(a > 0, jnp.maximum(s, _MIN_SCALE), 1.0)


def _row_max(ws: list[jax.Array]) -> jax.Array:
    """max |w| over every output column of weights [L, in, out_i] -> [L, in]."""
    return jnp.max(jnp.stack([jnp.max(jnp.abs(w), axis=-1) for w in ws]), axis=0)


def smoothing_factors(layers: dict, act_max: dict, alpha: Alpha, *, num_heads: int,
                      num_kv_heads: int) -> dict[str, jax.Array]:
    """Per-channel factors {group: s [L, channels]} for stacked float layers and calibration maxima.

    alpha: one value, or per group a value or one per layer ([L], as search_alpha returns).

    attn_out's factor is shared by the query heads of one KV group (it is folded into V, which
    they all read): channel d of head h uses KV head h // (num_heads // num_kv_heads)'s factor.
    """
    alphas = alpha if isinstance(alpha, Mapping) else {name: alpha for name, _ in INPUTS}
    bad = {name: a for name, a in alphas.items() if not np.all((np.asarray(a) >= 0.0) & (np.asarray(a) <= 1.0))}
    if bad or set(alphas) != {name for name, _ in INPUTS}:
        raise ValueError(f"smoothing alpha needs a value in [0, 1] for each of {[n for n, _ in INPUTS]}, "
                         f"got {dict(alphas)}")
    missing = [name for name, _ in INPUTS if name not in act_max]
    if missing:
        raise ValueError(f"calibration statistics lack {missing}; run models.calibration.activation_stats")
    return _group_factors(layers, act_max, alphas, num_heads=num_heads, num_kv_heads=num_kv_heads)


def _group_factors(layers: dict, act_max: dict, alphas: Mapping, *, num_heads: int,
                   num_kv_heads: int) -> dict[str, jax.Array]:
    out = {name: _factors(act_max[name], _row_max([layers[w] for w in ws]), alphas[name])
           for name, ws in INPUTS if name != "attn_out"}
    n_layers, width = act_max["attn_out"].shape
    head_dim, group = width // num_heads, num_heads // num_kv_heads

    def per_kv(x: jax.Array) -> jax.Array:  # [L, H*hd] -> max over each KV group's heads [L, KV, hd]
        return jnp.max(x.reshape(n_layers, num_kv_heads, group, head_dim), axis=2)

    s_kv = _factors(per_kv(act_max["attn_out"]), per_kv(_row_max([layers["wo"]])), alphas["attn_out"])
    out["attn_out"] = jnp.repeat(s_kv[:, :, None, :], group, axis=2).reshape(n_layers, width)
    return out


def smooth(params: dict[str, Any], act_max: dict, *, alpha: Alpha = DEFAULT_ALPHA, num_heads: int,
           num_kv_heads: int) -> tuple[dict[str, Any], dict[str, jax.Array]]:
    """(params with x / s, diag(s) W folded into every layer, the factors s per input group).

    params["layers"] holds stacked [L, ...] float leaves; act_max holds calibration maxima
    {group: [L, channels]} as models.calibration.activation_stats returns them.
    """
    layers = params.get("layers")
    if not isinstance(layers, dict):
        raise ValueError("smooth expects the stacked llama params (params['layers'] a dict of [L, ...] arrays)")
    s = smoothing_factors(layers, act_max, alpha, num_heads=num_heads, num_kv_heads=num_kv_heads)
    out = dict(layers)
    rows = lambda w, f: w * f[:, :, None]  # noqa: E731  [L, in, out] * s[L, in]
    out["attn_norm"] = layers["attn_norm"] / s["attn_in"]
    out["mlp_norm"] = layers["mlp_norm"] / s["mlp_in"]
    for name in ("wq", "wk", "wv"):
        out[name] = rows(layers[name], s["attn_in"])
    for name in ("w_gate", "w_up"):
        out[name] = rows(layers[name], s["mlp_in"])
    # attention output channel (h, d) is a convex mix of V's channel (h // group, d)
    n_layers, width = s["attn_out"].shape
    group = num_heads // num_kv_heads
    s_v = s["attn_out"].reshape(n_layers, num_kv_heads, group, width // num_heads)[:, :, 0].reshape(n_layers, -1)
    out["wv"] = out["wv"] / s_v[:, None, :]
    if "bv" in layers:
        out["bv"] = layers["bv"] / s_v
    out["wo"] = rows(layers["wo"], s["attn_out"])
    # silu(gate) * up is linear in up
    out["w_up"] = out["w_up"] / s["mlp_hidden"][:, None, :]
    out["w_down"] = rows(layers["w_down"], s["mlp_hidden"])
    return {**params, "layers": out}, s


def _fake_w8a8(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [L, N, C] @ w [L, C, O] as quantization/ops.py's w8a8 rounds it (per-row x, per-column w)."""
    def rnd(v, axis):
        scale = jnp.max(jnp.abs(v), axis=axis, keepdims=True) / INT8_MAX
        scale = jnp.where(scale > 0, scale, 1.0)
        return jnp.clip(jnp.round(v / scale), -INT8_MAX, INT8_MAX) * scale
    return jnp.einsum("lnc,lco->lno", rnd(x, -1), rnd(w, -2))


@functools.partial(jax.jit, static_argnames=("grid", "num_heads", "num_kv_heads"))
def search_alpha(layers: dict, act_max: dict, inputs: dict, *, grid: tuple[float, ...] = ALPHA_GRID,
                 num_heads: int, num_kv_heads: int) -> dict[str, jax.Array]:
    """Per layer and input group, the alpha in `grid` whose w8a8 output is closest to float:
    argmin over alpha of || Q(x / s) @ Q(diag(s) W) - x @ W ||^2 on calibration inputs.

    inputs: {group: x [L, N, C]}, a sample of the calibration rows each group reads. Returns
    {group: alpha [L]} for smoothing_factors. Each group is judged alone: the column scalings the
    other groups fold into V and up leave per-column int8 rounding unchanged.
    """
    weights = {name: jnp.concatenate([layers[w].astype(jnp.float32) for w in ws], axis=-1)
               for name, ws in INPUTS}                                                    # [L, C, O]
    ref = {name: jnp.einsum("lnc,lco->lno", inputs[name], weights[name]) for name, _ in INPUTS}

    def errors(alpha: jax.Array) -> dict[str, jax.Array]:  # {group: [L]}
        s = _group_factors(layers, act_max, {name: alpha for name, _ in INPUTS},
                              num_heads=num_heads, num_kv_heads=num_kv_heads)
        return {name: jnp.sum((_fake_w8a8(inputs[name] / s[name][:, None, :], weights[name] * s[name][:, :, None])
                               - ref[name]) ** 2, axis=(1, 2)) for name, _ in INPUTS}

    grid_arr = jnp.asarray(grid, jnp.float32)
    errs = jax.lax.map(errors, grid_arr)                                               # {group: [A, L]}
    return {name: grid_arr[jnp.argmin(e, axis=0)] for name, e in errs.items()}
