"""Fill in the middle: `/v1/completions` with a `suffix` asks a code model for what goes between the prompt and
the suffix. Models trained for it (Qwen2.5-Coder and Qwen3's `<|fim_prefix|>` family, StarCoder's `<fim_prefix>`
family) read the prefix-suffix-middle order, `<prefix tag>prompt<suffix tag>suffix<middle tag>`, and write the
middle; the tags are found in the served model's vocabulary at start-up."""
from __future__ import annotations

import dataclasses
from typing import Any

# (prefix, suffix, middle) tags per model family, tried in order
FAMILIES = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
            ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))


@dataclasses.dataclass(frozen=True)
class FimFormat:
    prefix: str
    suffix: str
    middle: str

    def text(self, before: str, after: str) -> str:
        """The prompt text of a fill between `before` and `after` (the tags encode as their single tokens)."""
        return f"{self.prefix}{before}{self.suffix}{after}{self.middle}"


def fim_format(tokenizer: Any) -> FimFormat | None:
    """The served model's fill-in-the-middle tags: the first family whose three tags are each one token that decodes
    back to itself; None when it has none (a `suffix` is then a 400)."""
    for tags in FAMILIES:
        if all(_one_token(tokenizer, tag) for tag in tags):
            return FimFormat(*tags)
    return None


def _one_token(tokenizer: Any, tag: str) -> bool:
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=False) == tag
