"""Fill in the middle: `/v1/completions` with a `suffix` (and llama.cpp's `/infill`) asks a code model for what goes
between the prompt and the suffix. Models trained for it (Qwen2.5-Coder and Qwen3's `<|fim_prefix|>` family,
StarCoder's `<fim_prefix>` family) read the prefix-suffix-middle order, `<prefix tag>prompt<suffix tag>suffix<middle
tag>`, and write the middle; the tags, and the repository-level ones for other files as context, are found in the
served model's vocabulary at start-up."""
from __future__ import annotations

import dataclasses
from typing import Any

# (prefix, suffix, middle) tags per model family, tried in order, and the family's repository-level tags (repository
# name, file separator) where it has them
FAMILIES = ((("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<|repo_name|>", "<|file_sep|>")),
            (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"), ("<repo_name>", "<file_sep>")))


@dataclasses.dataclass(frozen=True)
class FimFormat:
    prefix: str
    suffix: str
    middle: str
    repo: str | None = None      # repository-level tags (Qwen2.5-Coder's <|repo_name|>, <|file_sep|>), if the model has
    file_sep: str | None = None  # them

    def text(self, before: str, after: str) -> str:
        """The prompt text of a fill between `before` and `after` (the tags encode as their single tokens)."""
        return f"{self.prefix}{before}{self.suffix}{after}{self.middle}"

    def context(self, files: list[tuple[str, str]]) -> str:
        """Other files' (name, text) as the context before a fill: in the repository-level layout where the model has
        its tags (`<repo>myproject\\n`, each file as `<file_sep>name\\ntext`, then the filled file's `<file_sep>`),
        else the texts in turn; "" for none."""
        if not files:
            return ""
        return self.context_head() + "".join(self.context_file(name, text) for name, text in files) + \
            self.context_tail()

    def context_head(self) -> str:
        return "" if self.repo is None else f"{self.repo}myproject\n"

    def context_file(self, name: str, text: str) -> str:
        return text if self.repo is None else f"{self.file_sep}{name}\n{text}"

    def context_tail(self) -> str:
        return "" if self.repo is None else f"{self.file_sep}filename\n"


def fim_format(tokenizer: Any) -> FimFormat | None:
    """The served model's fill-in-the-middle tags: the first family whose three tags are each one token that decodes
    back to itself; None when it has none (a `suffix` is then a 400)."""
    for tags, repo_tags in FAMILIES:
        if all(_one_token(tokenizer, tag) for tag in tags):
            repo = all(_one_token(tokenizer, tag) for tag in repo_tags)
            return FimFormat(*tags, *(repo_tags if repo else (None, None)))
    return None


def _one_token(tokenizer: Any, tag: str) -> bool:
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=False) == tag
