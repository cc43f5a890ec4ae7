"""Mixtral: the Llama layout (Mistral attention, sliding_window may be null) with a sparse-MoE MLP
(models/moe.py): experts w1 (gate), w3 (up), w2 (down) of intermediate_size, the top-k weights renormalised."""
from __future__ import annotations

from slipstream.models.llama import Llama, llama_weights
from slipstream.models.moe import moe_weights


class Mixtral(Llama):
    WEIGHTS = llama_weights(moe_weights("block_sparse_moe.", "w1", "w3", "w2"))
