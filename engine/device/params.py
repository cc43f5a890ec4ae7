"""A loaded model as the engine runs it: int8 linears (by the model's declaration) and float leaves
in the activation dtype. Load time only; no step code here."""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from slipstream.models.base import CausalLM
from slipstream.models.layers import Linear
from slipstream.quantization import Int8Weight, QuantizedWeight, quantize_weight
from slipstream.quantization.experts import ExpertStack, quantize_experts
from slipstream.quantization.groupwise import QuantizedTable
from slipstream.quantization.weights import QUANTIZED_MODES, check_mode, head_mode


def prepare_model(model: CausalLM, mode: str, dtype, *, progress: bool = False) -> CausalLM:
    """Round the declared linear weights (models/base.Weight.linear, the LM head included) to `mode`
    and cast the remaining float weights to `dtype`, in place. A tied LM head gets int8 rows of the
    embedding table (the float table stays for the token lookup); the LM head takes weights.head_mode's mode
    ("int8" under "int4"); a sparse MoE's experts become per-channel int8 in every mode. Weights the loader already built
    as group-wise int8 (models.loader with quantize="q8_0") are kept: their floats never exist.
    quantization.int8's modes round each weight on its device, one tensor at a time."""
    check_mode(mode)
    if mode != "none":
        if model.lm_head is None:
            cfg = model.cfg
            table = model.embed.table.get_value()                                    # [vocab, embed]
            if isinstance(table, QuantizedTable):  # int8 rows (models.loader in a group-wise mode)
                table = table.dequantize()
            head = nnx.eval_shape(lambda: Linear(cfg.hidden_size, cfg.vocab_size, ("embed", "vocab")))
            if mode in QUANTIZED_MODES:
                from slipstream.quantization.groupwise import pack_one, quantize_rows

                head.w.set_value(pack_one(quantize_rows(np.asarray(table, np.float32)), mode))
            else:
                head.w.set_value(quantize_weight(jnp.asarray(table).T, head_mode(mode)))
            model.lm_head = head
        state = nnx.state(model, nnx.Param)
        flat = dict(nnx.to_flat_state(state))
        targets = [w for w in type(model).WEIGHTS if w.linear and tuple(w.path.split(".")) in flat]
        for w in tqdm(targets, desc=f"quantize {mode}", file=sys.stderr, disable=not progress, leave=False):
            var = flat[tuple(w.path.split("."))]
            if w.experts:  # per-channel int8 whatever the mode (quantization/experts.py)
                var.set_value(quantize_experts(var.get_value()))
                continue
            var.set_value(quantize_weight(var.get_value(), mode if w.per_layer else head_mode(mode)))
        nnx.update(model, state)

    state = nnx.state(model, nnx.Param)

    kept = QuantizedWeight | Int8Weight | QuantizedTable | ExpertStack

    def cast(x):
        if isinstance(x, ExpertStack):
            return x.astype(dtype)
        if isinstance(x, kept) or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return x.astype(dtype)

    nnx.update(model, jax.tree.map(cast, state, is_leaf=lambda x: isinstance(x, kept)))
    return model
