"""Reasoning models' thinking, apart from their answer.

Qwen3, QwQ and the DeepSeek-R1 distillations think first, between <think> and </think>, then answer. A chat
reply's text is split at those tags into its reasoning (`reasoning_content`, llama.cpp's and DeepSeek's name,
and `reasoning`, vLLM's newer one) and its `content`, whole or as stream deltas. Whether a reply starts inside
the thinking is read from its prompt's tokens: DeepSeek-R1's template ends the prompt with <think> (the reply
thinks at once; a reply cut before </think> is all reasoning), Qwen3's leaves the model to open it, or closes
an empty one when a request turns thinking off (`chat_template_kwargs: {"enable_thinking": false}`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from slipstream.server.tool_calls import partial_tail

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("auto", "think", "deepseek_r1", "qwen3", "none")  # vLLM's names select the same <think> parser


@dataclasses.dataclass(frozen=True)
class ReasoningFormat:
    """The tags around a model's thinking, each one token of its vocabulary."""

    open_id: int
    close_id: int
    open: str = OPEN
    close: str = CLOSE

    def starts_inside(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the prompt leaves the thinking open: its last opening tag comes after its last closing one."""
        return _last(prompt_ids, self.open_id) > _last(prompt_ids, self.close_id)

    def split(self, text: str, inside: bool, *, final: bool = True) -> tuple[str, str]:
        """(reasoning, content) of a reply's text; `inside`: the prompt opened the thinking. The newlines
        around the thinking and before the answer are dropped, as chat templates drop them from earlier turns.
        final=False (the reply goes on): what is settled so far, without a tail that may still become a tag or
        newlines that may still end the reasoning; each such result is a prefix of the later ones."""
        if not inside:
            stripped = text.lstrip()
            if stripped.startswith(self.open):
                text = stripped[len(self.open):]
            elif not final and self.open.startswith(stripped):  # may still open the thinking
                return "", ""
            else:
                return "", text
        reasoning, closed, content = text.partition(self.close)
        if closed:
            return reasoning.strip("\n"), content.lstrip("\n")
        if not final:
            reasoning = reasoning[:len(reasoning) - partial_tail(reasoning, self.close)]
        return reasoning.strip("\n"), ""


class ReasoningStream:
    """One streamed choice's reasoning and content deltas: feed() each piece of text, finish() at the end."""

    def __init__(self, fmt: ReasoningFormat, inside: bool) -> None:
        self.fmt, self.inside = fmt, inside
        self.text = ""
        self.sent_reasoning = self.sent_content = 0
        self.answering = False  # the thinking has closed (or never opened): what follows is content

    def feed(self, piece: str) -> tuple[str, str]:
        if self.answering and self.sent_content:  # the common case, without re-reading the reply
            self.text += piece
            self.sent_content += len(piece)
            return "", piece
        self.text += piece
        return self._settled(final=False)

    def finish(self) -> tuple[str, str]:
        return self._settled(final=True)

    def _settled(self, final: bool) -> tuple[str, str]:
        reasoning, content = self.fmt.split(self.text, self.inside, final=final)
        self.answering = bool(content)
        out = reasoning[self.sent_reasoning:], content[self.sent_content:]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return out


def _last(ids: Sequence[int], token: int) -> int:
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1


def reasoning_format(tokenizer: Any, parser: str) -> ReasoningFormat | None:
    """The served model's reasoning format for --reasoning-parser: None for "none", and for "auto" when the
    vocabulary has no <think> and </think> tokens; ValueError when a named parser's tags are not tokens of it."""
    if parser not in PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(PARSERS)}, got {parser!r}")
    if parser == "none":
        return None
    ids = {tag: _single_token(tokenizer, tag) for tag in (OPEN, CLOSE)}
    missing = [tag for tag, token in ids.items() if token is None]
    if missing:
        if parser == "auto":
            return None
        raise ValueError(f"--reasoning-parser {parser}: the model's vocabulary has no {' or '.join(missing)} token "
                         "(a reasoning model's tags are single tokens); use --reasoning-parser none")
    return ReasoningFormat(open_id=ids[OPEN], close_id=ids[CLOSE])


def _single_token(tokenizer: Any, tag: str) -> int | None:
    """The id of `tag` when it is one token that decodes back to itself (not dropped as a special token)."""
    ids = tokenizer.encode(tag, add_special_tokens=False)
    if len(ids) != 1 or tokenizer.decode(ids) != tag:
        return None
    return ids[0]
