"""LoRA adapters in PEFT's format (adapter_config.json + adapter_model.safetensors), read and checked
against a base model: which linears they target, their rank and scale. Host numpy only (no JAX at
import); the engine puts them in its device slots. A bad adapter fails with a LoraError naming the
file and the tensor."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re

from typing import TYPE_CHECKING

import numpy as np

from slipstream.models.safetensors_file import SafetensorsError, SafetensorsFile

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
if TYPE_CHECKING:
    from slipstream.models.base import CausalLM

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraError(ValueError):
    """An adapter that cannot be served on this model (the message names the file and the field or tensor)."""


@dataclasses.dataclass(frozen=True)
class Target:
    """One linear an adapter may target: its PEFT module name, its place in the module tree
    ("blocks.attn.wq.w"), the checkpoint name pattern ("model.layers.{i}.self_attn.q_proj") and shape."""

    module: str
    path: str
    hf_prefix: str
    d_in: int
    d_out: int


def lora_targets(model: "CausalLM") -> dict[str, Target]:
    """The targetable linears of `model` (its per-layer linear weights named like MODULES), by module
    name, with their [in, out] shapes as loaded (before the engine rounds them)."""
    from flax import nnx  # here only: reading adapters (the server's registry) needs no JAX

    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    targets = {}
    for w in type(model).WEIGHTS:
        key = tuple(w.path.split("."))
        if not (w.linear and w.per_layer and w.hf.endswith(".weight") and key in flat) or w.experts:
            continue
        prefix = w.hf[:-len(".weight")]
        module = prefix.rsplit(".", 1)[-1]
        if module in MODULES:
            shape = flat[key].get_value().shape                                       # [L, in, out]
            targets[module] = Target(module, w.path, prefix, int(shape[-2]), int(shape[-1]))
    return targets


@dataclasses.dataclass(frozen=True, eq=False)
class LoraAdapter:
    """A checked adapter: per targeted module A [L, in, r] and B [L, r, out] (f32, the scale folded
    into B; zeros for layers it leaves out). digest: its content (weights and scale), so that KV
    computed under it is never shared with another adapter's (the prefix cache's salt)."""

    name: str
    path: str
    rank: int
    scale: float
    weights: dict[str, tuple[np.ndarray, np.ndarray]]
    digest: bytes

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(self.weights)


def resolve_under(root: str, path: str) -> str:
    """The real directory `path` names (relative to `root`, or absolute), refused unless it lies
    inside `root` once `..` and symlinks are resolved."""
    if not root:
        raise LoraError("no --lora-root is set: adapters load only from directories under it")
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, path))
    if os.path.commonpath([real_root, real]) != real_root or real == real_root:
        raise LoraError(f"lora_path {path!r} is outside --lora-root {root!r}")
    return real


def _config(path: str, max_rank: int, num_layers: int) -> tuple[int, float, set[int] | None]:
    """adapter_config.json's rank, scale (lora_alpha / r, or / sqrt(r) with rslora) and layers (None: all)."""
    file = os.path.join(path, CONFIG_FILE)
    try:
        with open(file) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise LoraError(f"{file}: missing (a PEFT adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE})") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoraError(f"{file}: not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"{file}: not a JSON object")

    def bad(field, why):
        return LoraError(f"{file}: {field} {why}")

    if cfg.get("peft_type", "LORA") != "LORA":
        raise bad("peft_type", f"is {cfg.get('peft_type')!r}; only LORA adapters are served")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= max_rank:
        raise bad("r", f"must be an integer in [1, {max_rank}] (--max-lora-rank), got {r!r}")
    alpha = cfg.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise bad("lora_alpha", f"must be a number, got {alpha!r}")
    for field, off in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if cfg.get(field, off) not in (off, None):
            raise bad(field, f"is {cfg[field]!r}; only {off!r} is supported")
    for field in ("rank_pattern", "alpha_pattern", "modules_to_save", "layer_replication"):
        if cfg.get(field):
            raise bad(field, f"is set ({cfg[field]!r}); adapters with per-module ranks, saved modules or "
                             "replicated layers are not supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(MODULES))
        if unknown:
            raise bad("target_modules", f"names {unknown}; supported: {', '.join(MODULES)}")
    layers = cfg.get("layers_to_transform")
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if layers is not None:
        if not isinstance(layers, list) or any(not isinstance(i, int) or not 0 <= i < num_layers for i in layers):
            raise bad("layers_to_transform", f"must be layer indices in [0, {num_layers}), got {layers!r}")
        layers = set(layers)
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(scale), layers


_KEY = re.compile(r"^base_model\.model\.(?P<prefix>.+)\.lora_(?P<ab>[AB])\.weight$")


def load_adapter(name: str, path: str, targets: dict[str, Target], num_layers: int, max_rank: int) -> LoraAdapter:
    """Read and check the PEFT adapter in directory `path` (already resolved under --lora-root)."""
    if not os.path.isdir(path):
        raise LoraError(f"{path}: not a directory (a PEFT adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    r, scale, layers = _config(path, max_rank, num_layers)
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise LoraError(f"{file}: missing ({WEIGHTS_FILE} holds the adapter's lora_A / lora_B tensors)")
    try:
        st = SafetensorsFile(file)
    except SafetensorsError as e:
        raise LoraError(str(e)) from None
    patterns = [(re.compile("^" + re.escape(t.hf_prefix).replace(re.escape("{i}"), r"(?P<layer>[0-9]+)") + "$"), t)
                for t in targets.values()]
    found: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    for tensor, (dtype, shape, _, _) in st.entries.items():
        m = _KEY.match(tensor)
        target, layer = None, None
        if m:
            for pattern, t in patterns:
                if pm := pattern.match(m["prefix"]):
                    target, layer = t, int(pm["layer"])
                    break
        if target is None:
            raise LoraError(f"{file}: tensor {tensor} is not a lora_A/lora_B weight of a supported module "
                            f"({', '.join(MODULES)} of this model's layers)")
        if not 0 <= layer < num_layers or (layers is not None and layer not in layers):
            raise LoraError(f"{file}: tensor {tensor} is for layer {layer}, which the base model "
                            f"({num_layers} layers) or layers_to_transform leaves out")
        want = (r, target.d_in) if m["ab"] == "A" else (target.d_out, r)
        if shape != want:
            raise LoraError(f"{file}: tensor {tensor} has shape {list(shape)}, the base model needs {list(want)} "
                            f"(r={r}, {target.module} is [{target.d_in} -> {target.d_out}])")
        if not np.issubdtype(dtype, np.floating) and dtype.name != "bfloat16":
            raise LoraError(f"{file}: tensor {tensor} has dtype {dtype}; LoRA weights are floats")
        value = st.read(tensor).astype(np.float32)
        if not np.isfinite(value).all():
            raise LoraError(f"{file}: tensor {tensor} holds NaN or infinite values")
        found.setdefault(target.module, {}).setdefault(layer, {})[m["ab"]] = value
    if not found:
        raise LoraError(f"{file}: holds no lora_A/lora_B tensors")
    weights = {}
    digest = hashlib.blake2b(json.dumps([r, scale]).encode(), digest_size=16)
    for module in (m for m in MODULES if m in found):
        target, per_layer = targets[module], found[module]
        expect = sorted(layers) if layers is not None else range(num_layers)
        for i in expect:
            for ab in "AB":
                if ab not in per_layer.get(i, {}):
                    raise LoraError(f"{file}: tensor base_model.model.{target.hf_prefix.format(i=i)}.lora_{ab}.weight "
                                    f"is missing ({module} is targeted in other layers)")
        a = np.zeros((num_layers, target.d_in, r), np.float32)
        b = np.zeros((num_layers, r, target.d_out), np.float32)
        for i, ab in per_layer.items():
            a[i] = ab["A"].T                                                          # [in, r]
            b[i] = ab["B"].T * scale                                                  # [r, out]
        weights[module] = (a, b)
        digest.update(module.encode())
        digest.update(a.tobytes())
        digest.update(b.tobytes())
    return LoraAdapter(name=name, path=path, rank=r, scale=scale, weights=weights, digest=digest.digest())
