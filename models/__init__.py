"""Model math and loading. Every architecture is a Flax NNX module tree over the shared layers.

The seam (models/base.py): a `CausalLM` is built from a `ModelConfig`, filled by the loaders from its
`WEIGHTS` declaration (checkpoint names in HF and GGUF, linear or not), describes its KV cache
(`kv_cache_shape`), and runs one ragged step (`base.step`: flat tokens over the paged cache, the
sampling rows' logits). Each weight's logical axes sit on its `nnx.Param` (`sharding_names`). The
engine splits the module once and merges it inside its jitted programs (`base.step_fn`).

Adding an architecture (Gemma 3 in models/gemma3.py is a complete example):
1. models/config.py: map its HF `architectures` name (and model_type; GGUF `general.architecture` in
   models/gguf_config.py if it has one) to a new architecture name, and read any new config fields (a flag here,
   not an `if` on the name inside layer code).
2. models/<name>.py: a `CausalLM` subclass with its block module built from models/layers.py
   (Attention, GatedMLP, RMSNorm, Linear; models/moe.py's SparseMoE and moe_weights for a mixture of experts,
   whose expert tensors are declared with Weight(experts=True); add a shared layer there if another model may use it),
   its `WEIGHTS` (one `Weight` per parameter path), and `block` (plus `embed_tokens` / `logits`
   hooks if they differ).
3. models/architectures.py: register the class.
4. tests/conftest.py `build_tiny_hf`: a tiny random transformers checkpoint of it; add the family to
   tests/models/test_architectures_vs_hf.py (logits within 1e-4 of transformers, dense and through
   the engine's ragged steps).
The engine, loaders, quantization and kernels need no change.

A vision-language model (models/llava.py, models/idefics3.py) adds a tower and a projector as submodules
(models/vision.py; their weights declared with `stacked_by` for the tower's own layer count, and HF_ALIASES for a
checkpoint's other layouts), an `encode_images(pixels) -> [B, rows, hidden]` method, `ModelConfig.vision` /
`image_token_id`, and its processor in models/image_processor.py (or its own: models/idefics3_processor.py, whose
tiles server/images.py lays out in the prompt); its prompt's image rows reach the text model through
`CausalLM.hidden`'s `embeds`.
"""
