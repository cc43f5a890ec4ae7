"""Architecture name (ModelConfig.architecture) -> its NNX module class, and building one."""
from __future__ import annotations

from flax import nnx

from slipstream.models.base import CausalLM
from slipstream.models.config import ModelConfig
from slipstream.models.gemma3 import Gemma3
from slipstream.models.idefics3 import Idefics3
from slipstream.models.llama import Llama
from slipstream.models.llava import Llava
from slipstream.models.mixtral import Mixtral
from slipstream.models.phi3 import Phi3
from slipstream.models.qwen3 import Qwen3
from slipstream.models.qwen3_moe import Qwen3Moe

ARCHITECTURES: dict[str, type[CausalLM]] = {"llama": Llama, "qwen2": Llama, "qwen3": Qwen3, "gemma3": Gemma3,
                                            "qwen3_moe": Qwen3Moe, "mixtral": Mixtral, "olmoe": Qwen3Moe, "phi3": Phi3,
                                            "llava": Llava, "idefics3": Idefics3}


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    try:
        return ARCHITECTURES[cfg.architecture]
    except KeyError:
        raise ValueError(f"architecture {cfg.architecture!r} is not supported; supported: "
                         f"{', '.join(ARCHITECTURES)}") from None


def build_abstract(cfg: ModelConfig) -> CausalLM:
    """The module tree with shape-only weights (no memory), for a loader to fill."""
    return nnx.eval_shape(lambda: model_class(cfg)(cfg))
