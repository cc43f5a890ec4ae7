"""PEFT adapters for the tiny random Llama (made by `peft`, with random non-zero B), and the
transformers + peft reference: logits and greedy tokens of one prompt under one adapter."""
from __future__ import annotations

import functools
import os

import numpy as np

# name -> (rank, alpha, target modules, rslora)
ADAPTERS = {
    "attn": (4, 8, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
    "mlp": (8, 16, ["gate_proj", "up_proj", "down_proj"], False),
    "all": (6, 12, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
}


def make_adapter(base_dir: str, out: str, rank: int, alpha: float, modules: list[str], rslora: bool = False,
                 seed: int = 0) -> str:
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, lora_dropout=0.0,
                                            use_rslora=rslora))
    with torch.no_grad():  # peft starts B at zero (no change): make every adapter matter
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out)
    return out


def make_adapters(base_dir: str, root: str) -> dict[str, str]:
    """The three ADAPTERS under `root`: name -> directory."""
    return {name: make_adapter(base_dir, os.path.join(root, name), r, a, m, rs, seed=i)
            for i, (name, (r, a, m, rs)) in enumerate(ADAPTERS.items())}


@functools.lru_cache(maxsize=None)
def _reference(base_dir: str, adapter_dir: str | None):
    import torch
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


def reference_greedy(base_dir: str, adapter_dir: str | None, prompt: list[int], n: int
                     ) -> tuple[list[int], np.ndarray]:
    """transformers (+ peft): n greedy tokens after `prompt`, and the logits [n, V] that chose them."""
    import torch

    model = _reference(base_dir, adapter_dir)
    threads = torch.get_num_threads()
    # one thread: a tiny model gains nothing from more, and on a busy 2-core machine torch's threads
    # spin against each other (30 tokens took 6 s with 2, 0.05 s with 1)
    torch.set_num_threads(1)
    try:
        ids, rows = list(prompt), []
        with torch.no_grad():
            for _ in range(n):
                logits = model(torch.tensor([ids])).logits[0, -1].numpy()
                rows.append(logits)
                ids.append(int(logits.argmax()))
        return ids[len(prompt):], np.stack(rows)
    finally:
        torch.set_num_threads(threads)
