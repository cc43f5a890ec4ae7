"""The sparse mixture-of-experts MLP shared by every MoE architecture (Qwen3-MoE, Mixtral, OLMoE): a router picks
each token's top-k experts, and only those run. The step's (token, expert) pairs are sorted by expert and multiplied
group by group: with the CPU's packed int8 experts, one native call per projection over every expert's rows
(quantization/experts.grouped_mlp); with int8 experts on TPU, the sorted rows padded to whole blocks (each block one
expert's) through kernels/tpu/expert_matmul.py, gate and up in one call; with float experts on TPU, one grouped matmul
(ragged_dot) for steps of at least as many pairs as experts; elsewhere a loop over the same blocks that runs only
the blocks the step uses (XLA:CPU lowers ragged_dot to a dense product over every expert). Expert weights are
quantization/experts.py's stacks [L, E, in, out]; under tensor parallelism each device runs `mixture` on its slice of
every expert's hidden dimension (engine/device/sharding.py's ShardedExperts)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from slipstream.models import layers
from slipstream.models.base import Weight
from slipstream.models.config import ModelConfig
from slipstream.quantization import experts as ex

MIN_BLOCK, MAX_BLOCK = 8, 64  # rows per block of the block loop (block_rows)
# rows per block of the TPU kernel: a bf16 sublane tile at least; a prefill chunk's experts read about once
KERNEL_MIN_BLOCK, KERNEL_MAX_BLOCK = 16, 128


def moe_weights(prefix: str, gate: str, up: str, down: str) -> tuple[Weight, ...]:
    """An MoE MLP's weights: the router [E, D] as checkpoints hold it and the experts' gate / up / down
    (`prefix`: the MLP's checkpoint name under a layer, e.g. "mlp." or Mixtral's "block_sparse_moe.")."""
    hf, gg = "model.layers.{i}." + prefix, "blk.{i}."  # GGUF: every expert of a layer in one tensor [E, out, in]
    return (
        Weight("blocks.mlp.router", hf + "gate.weight", gg + "ffn_gate_inp.weight"),
        Weight("blocks.mlp.w_gate", hf + f"experts.{{e}}.{gate}.weight", gg + "ffn_gate_exps.weight", linear=True,
               experts=True),
        Weight("blocks.mlp.w_up", hf + f"experts.{{e}}.{up}.weight", gg + "ffn_up_exps.weight", linear=True,
               experts=True),
        Weight("blocks.mlp.w_down", hf + f"experts.{{e}}.{down}.weight", gg + "ffn_down_exps.weight", linear=True,
               experts=True),
    )


class SparseMoE(nnx.Module):
    """sum over the token's top-k experts of p_e * down_e(silu(gate_e(x)) * up_e(x)), p the router's softmax
    (renormalised over the top k when cfg.norm_topk_prob)."""

    def __init__(self, cfg: ModelConfig, *, layers_: int):
        d, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        self.router = _stacked((layers_, e, d), ("expert", "embed"))
        self.w_gate = _stacked((layers_, e, d, f), ("expert", "embed", "mlp"))
        self.w_up = _stacked((layers_, e, d, f), ("expert", "embed", "mlp"))
        self.w_down = _stacked((layers_, e, f, d), ("expert", "mlp", "embed"))
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob

    def __call__(self, x: jax.Array) -> jax.Array:
        router = self.router.get_value()                                              # [E,D]
        logits = jnp.einsum("td,ed->te", x, router.astype(x.dtype), preferred_element_type=jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1)                                       # [T,E] f32
        weights, chosen = jax.lax.top_k(probs, self.top_k)                            # [T,k]
        if self.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        picks = tuple(m.get_value() for m in (self.w_gate, self.w_up, self.w_down))
        chosen = chosen.reshape(-1).astype(jnp.int32)                                 # [T*k]
        if hasattr(picks[0], "per_device"):  # tensor parallel: each device its slice of the experts, summed
            mix = functools.partial(mixture, top_k=self.top_k)
            return picks[0].per_device(mix, x, chosen, weights, picks).astype(x.dtype)
        return mixture(x, chosen, weights, picks, self.top_k).astype(x.dtype)


def mixture(x: jax.Array, chosen: jax.Array, weights: jax.Array, picks: tuple, top_k: int) -> jax.Array:
    """The experts' outputs weighted and summed per token: x [T, D], chosen [T*k], weights [T, k] -> f32 [T, D]. A
    sum over the experts' hidden dimension, so under tensor parallelism (engine/device/sharding.py) each device
    runs this on its slice of it and the devices' results add up, as a dense MLP's row-parallel down projection."""
    t, d = x.shape
    y = expert_rows(x, chosen, picks, top_k)                                          # [T*k,D] f32
    # HF weighs each expert's output in the activation dtype (under tensor parallelism, each device's share of it)
    y = y.astype(x.dtype) * weights.reshape(-1, 1).astype(x.dtype)
    return jnp.sum(y.reshape(t, top_k, d).astype(jnp.float32), axis=1)


def _stacked(shape: tuple[int, ...], axes: tuple[str, ...]) -> nnx.Param:
    return layers.param(shape, (layers.LAYERS, *axes))


def expert_rows(x: jax.Array, chosen: jax.Array, picks: tuple, top_k: int) -> jax.Array:
    """Each (token, expert) pair's expert output, unweighted: x [T, D], chosen [T*k] (pair j is token j // k's)
    -> f32 [T*k, D]. picks: the layer's gate, up and down experts (quantization/experts.py's picks)."""
    experts = picks[0].experts
    order = jnp.argsort(chosen, stable=True)                                          # [P] pairs by expert
    sizes = jnp.bincount(chosen, length=experts).astype(jnp.int32)                    # [E]
    # the CPU's packed experts: every expert's rows in one kernel call per projection
    if (y := ex.grouped_mlp(x[order // top_k], sizes, picks, x.dtype)) is not None:  # [P,D] sorted
        return y[jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))]
    args = (x, chosen, order, sizes)
    blocks = functools.partial(_block_rows, picks=picks, top_k=top_k)
    if ex.kernel_applies(picks, x):
        return jax.lax.platform_dependent(*args, tpu=functools.partial(kernel_rows, picks=picks, top_k=top_k),
                                          default=blocks)
    # with fewer pairs than experts (a small decode step) the block loop reads at most one expert per pair, where
    # ragged_dot's operand is every expert of the layer
    if not ex.has_ragged(picks) or chosen.shape[0] < experts:
        return blocks(*args)
    return jax.lax.platform_dependent(*args, tpu=functools.partial(_ragged_rows, picks=picks, top_k=top_k),
                                      default=blocks)


def _gated(x: jax.Array, gate: jax.Array, up: jax.Array) -> jax.Array:
    return (jax.nn.silu(gate) * up).astype(x.dtype)


def _ragged_rows(x, chosen, order, sizes, *, picks, top_k):
    """The grouped path: the sorted rows through ragged_dot, then back in pair order."""
    gate, up, down = picks
    rows = x[order // top_k]                                                          # [P,D] sorted
    row_expert = chosen[order]
    h = _gated(x, gate.ragged(rows, sizes, row_expert), up.ragged(rows, sizes, row_expert))
    y = down.ragged(h, sizes, row_expert)                                             # [P,D] sorted
    return jnp.zeros_like(y).at[order].set(y)


def block_rows(pairs: int, experts: int, lo: int = MIN_BLOCK, hi: int = MAX_BLOCK) -> int:
    """Rows per block: about the pairs an expert gets on average (a power of two in [lo, hi]), so a decode step's
    few rows run in small blocks and a prefill chunk's read each expert's weights a few times."""
    mean = -(-pairs // experts)
    return min(hi, max(lo, 1 << (mean - 1).bit_length()))


def _layout(chosen, order, sizes, tokens: int, top_k: int, b: int):
    """Each expert's sorted rows padded to whole blocks of b rows -> (row_token [C*b]: each padded row's token,
    `tokens` for padding; block_expert [C]; used: the blocks in use (traced); slot [P]: each pair's padded row).
    C = P/b + min(E, P) blocks, an upper bound."""
    p, e = chosen.shape[0], sizes.shape[0]
    capacity = -(-p // b) + min(e, p)
    per_expert = -(-sizes // b)                                                       # [E] blocks of each expert
    first_block = jnp.cumsum(per_expert) - per_expert                                 # [E]
    sorted_expert = chosen[order]                                                     # [P]
    rank = jnp.arange(p, dtype=jnp.int32) - (jnp.cumsum(sizes) - sizes)[sorted_expert]
    sorted_slot = first_block[sorted_expert] * b + rank                               # [P] padded row, sorted
    row_token = jnp.full((capacity * b,), tokens, jnp.int32).at[sorted_slot].set((order // top_k).astype(jnp.int32))
    # block i's expert: how many experts' blocks end at or before it (compared all at once: no loop on TPU)
    ends = jnp.cumsum(per_expert)
    block_expert = jnp.minimum(jnp.searchsorted(ends, jnp.arange(capacity), side="right", method="compare_all"), e - 1)
    slot = jnp.zeros((p,), jnp.int32).at[order].set(sorted_slot)                      # [P] pair order
    return row_token, block_expert.astype(jnp.int32), jnp.sum(per_expert), slot


def _block_rows(x, chosen, order, sizes, *, picks, top_k):
    """The block path: each expert's sorted rows padded to whole blocks of B rows; a loop over the used blocks
    (a traced count, at most P/B + E) multiplies each block by its one expert's weights."""
    gate, up, down = picks
    t, d = x.shape
    b = block_rows(chosen.shape[0], sizes.shape[0])
    row_token, block_expert, used, slot = _layout(chosen, order, sizes, t, top_k, b)
    padded_x = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])                       # row t: padding

    def body(i, out):
        tokens = jax.lax.dynamic_slice_in_dim(row_token, i * b, b)
        rows, expert = padded_x[tokens], block_expert[i]                              # [B,D]
        h = _gated(x, gate.matmul(rows, expert), up.matmul(rows, expert))             # [B,F]
        return jax.lax.dynamic_update_slice_in_dim(out, down.matmul(h, expert), i * b, 0)

    out = jax.lax.fori_loop(0, used, body, jnp.zeros((row_token.shape[0], d), jnp.float32))
    return out[slot]                                                                  # [P,D] pair order


def kernel_rows(x, chosen, order, sizes, *, picks, top_k, block: int | None = None, interpret: bool = False):
    """The TPU's path for int8 experts: the block layout's rows through kernels/tpu/expert_matmul.py, one call for
    gate and up (silu(gate) * up formed in the kernel) and one for down; no loop, and only the used experts read.
    block: rows per block (default block_rows with the kernel's bounds); interpret: Pallas' TPU interpreter (tests
    run this on CPU)."""
    gate, up, down = picks
    t, d = x.shape
    b = block or block_rows(chosen.shape[0], sizes.shape[0], KERNEL_MIN_BLOCK, KERNEL_MAX_BLOCK)
    row_token, block_expert, used, slot = _layout(chosen, order, sizes, t, top_k, b)
    rows = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])[row_token]                # [C*B,D] row t: padding
    h = ex.kernel_gated(gate, up, rows, block_expert, used, b, interpret=interpret)   # [C*B,F] x's dtype
    return ex.kernel_matmul(down, h, block_expert, used, b, interpret=interpret)[slot]  # [P,D] f32
