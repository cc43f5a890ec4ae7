"""llama.cpp's response shapes for /completion and /infill: one result object per choice (`content`, `stop_type`,
`stopping_word`, `timings`, ...), or with `stream` server-sent events of partial results (`"stop": false`) and each
choice's final one (`"stop": true`), no `[DONE]`. Also llama.cpp's two code-completion stops, which the front end
applies as the text arrives: `n_indent` (a new line indented less ends the reply before it) and `t_max_predict_ms`
(past that time, a newline ends it)."""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, AsyncIterator

from slipstream.engine.request import FinishReason, TokenLogprob
from slipstream.engine.request_stream import Delta
from slipstream.server.errors import service_error
from slipstream.server.gate import error_body
from slipstream.server.generation import Generation
from slipstream.server.llamacpp import SAMPLERS, LlamaCompletionRequest
from slipstream.server.service import Service


@dataclasses.dataclass
class _Choice:
    """One choice's reply so far."""

    text: str = ""
    tokens: list[int] = dataclasses.field(default_factory=list)
    probs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    first_at: float | None = None     # when its first token arrived
    end_at: float | None = None
    checked: int = 0                  # text before this is past n_indent's check
    stop_type: str | None = None      # eos, word, limit
    stopping_word: str = ""


class LlamaFormat:
    """Results and stream events for one Generation of a /completion or /infill request."""

    def __init__(self, service: Service, gen: Generation, req: LlamaCompletionRequest, started: float) -> None:
        self.service, self.gen, self.req, self.started = service, gen, req, started
        self.model = req.model or service.model_name
        self.choices = [_Choice() for _ in range(gen.num_choices)]
        self.stops = sorted(req.stop, key=len, reverse=True)

    # ---- following the text --------------------------------------------------------------------

    def feed(self, d: Delta) -> tuple[str, bool]:
        """Take one Delta in: the text it adds to its choice (after llama.cpp's stops), and whether the choice ended."""
        c = self.choices[d.index]
        now = time.monotonic()
        if c.first_at is None:
            c.first_at = now
        text = self._without_stop_word(c, d)
        c.tokens += d.token_ids
        c.probs += [self._prob(lp) for lp in d.logprobs or ()]
        start = len(c.text)
        c.text += text
        if self._cut_at_indent(c) or (d.finish_reason is None and self._past_time(c, text, now)):
            c.stop_type, c.stopping_word = "limit", ""
            if d.finish_reason is None:
                self.gen.cut(d.index)
        elif d.finish_reason is not None:
            c.stop_type = c.stop_type or ("limit" if d.finish_reason is FinishReason.LENGTH else "eos")
        if c.stop_type is not None:
            c.end_at = now
        return c.text[start:], c.stop_type is not None

    def _without_stop_word(self, c: _Choice, d: Delta) -> str:
        """The engine keeps a matched stop string in the text (include_stop_str_in_output) so that it can be named:
        the earliest match ends the text, so it is the longest stop string the last Delta ends with."""
        whole = c.text + d.text
        found = next((s for s in self.stops if whole.endswith(s)), None) if d.finish_reason is FinishReason.STOP else None
        if found is None:
            return d.text
        c.stop_type, c.stopping_word = "word", found
        keep = len(whole) - len(found)
        c.text = whole[:min(keep, len(c.text))]
        return whole[len(c.text):keep]

    def _cut_at_indent(self, c: _Choice) -> bool:
        """n_indent: a line after the first whose text starts at less indentation ends the reply at that text."""
        if self.req.n_indent <= 0:
            return False
        while (nl := c.text.find("\n", c.checked)) != -1:
            line = nl + 1
            pos = line
            while pos < len(c.text) and c.text[pos] in " \t":
                pos += 1
            if pos == len(c.text):
                return False  # the line's text has not come yet
            if pos - line < self.req.n_indent and c.text[pos] != "\n":
                c.text = c.text[:pos]
                return True
            c.checked = line
        return False

    def _past_time(self, c: _Choice, text: str, now: float) -> bool:
        limit = self.req.t_max_predict_ms
        return limit > 0 and "\n" in text and (now - c.first_at) * 1000 > limit

    def _prob(self, lp: TokenLogprob) -> dict[str, Any]:
        return {**self._token(lp.token_id), "logprob": _finite(lp.logprob),
                "top_logprobs": [{**self._token(t), "logprob": _finite(v)} for t, v in lp.top]}

    def _token(self, token_id: int) -> dict[str, Any]:
        text = self.service.token_text(token_id)
        return {"id": token_id, "token": text, "bytes": list(text.encode("utf-8", "replace"))}

    # ---- bodies ----------------------------------------------------------------------------------

    def result(self, index: int, last: tuple[str, list[int]] | None = None) -> dict[str, Any]:
        """Choice `index`'s final result: its whole text (and ids, with return_tokens), or in a stream the `last` text
        and ids."""
        c = self.choices[index]
        prompt_ids = self.gen.prompt_ids(index)
        content, tokens = (c.text, c.tokens if self.req.return_tokens else []) if last is None else last
        body = {"index": index, "content": content, "tokens": tokens, "id_slot": -1, "stop": True,
                "model": self.model, "tokens_predicted": len(c.tokens), "tokens_evaluated": len(prompt_ids),
                "generation_settings": self.settings(),
                "prompt": self.service.tokenizer.decode(prompt_ids, skip_special_tokens=False),
                "has_new_line": "\n" in c.text, "truncated": False, "stop_type": c.stop_type or "none",
                "tokens_cached": self.gen.cached_in(index),
                "stopping_word": c.stopping_word, "timings": self.timings(index)}
        if self.req.n_probs:
            body["completion_probabilities"] = c.probs
        return self.fields(body)

    def partial(self, index: int, text: str, tokens: list[int], probs: list[dict[str, Any]]) -> dict[str, Any]:
        c = self.choices[index]
        body = {"index": index, "content": text, "tokens": tokens, "stop": False, "id_slot": -1,
                "tokens_predicted": len(c.tokens), "tokens_evaluated": len(self.gen.prompt_ids(index))}
        if self.req.n_probs:
            body["completion_probabilities"] = probs
        if self.req.timings_per_token:
            body["timings"] = self.timings(index)
        return self.fields(body)

    def settings(self) -> dict[str, Any]:
        r = self.req
        return {"n_predict": r.n_predict, "temperature": r.temperature, "top_k": r.top_k, "top_p": r.top_p,
                "min_p": r.min_p, "repeat_penalty": r.repeat_penalty, "presence_penalty": r.presence_penalty,
                "frequency_penalty": r.frequency_penalty, "seed": r.seed, "stop": r.stop, "ignore_eos": r.ignore_eos,
                "n_probs": r.n_probs, "stream": r.stream, "n_indent": r.n_indent,
                "t_max_predict_ms": r.t_max_predict_ms, "samplers": list(SAMPLERS if r.samplers is None else r.samplers),
                "n_ctx": self.service.max_seq_len, "model": self.model}

    def timings(self, index: int) -> dict[str, Any]:
        """Prompt time: from the request's arrival to its first token (queueing included); predicted time: from
        there to the last token so far."""
        c = self.choices[index]
        first = c.first_at if c.first_at is not None else time.monotonic()
        end = c.end_at if c.end_at is not None else time.monotonic()
        prompt_n = len(self.gen.prompt_ids(index))
        prompt_ms, predicted_ms, predicted_n = (first - self.started) * 1000, (end - first) * 1000, len(c.tokens)
        return {"prompt_n": prompt_n, "prompt_ms": prompt_ms, "prompt_per_token_ms": _per(prompt_ms, prompt_n),
                "prompt_per_second": _rate(prompt_n, prompt_ms), "predicted_n": predicted_n,
                "predicted_ms": predicted_ms, "predicted_per_token_ms": _per(predicted_ms, predicted_n),
                "predicted_per_second": _rate(predicted_n, predicted_ms)}

    def fields(self, body: dict[str, Any]) -> dict[str, Any]:
        """response_fields: only those, a nested one (`timings/prompt_n`) moved to the top under its last name;
        missing ones left out, as llama.cpp."""
        if self.req.response_fields is None:
            return body
        out = {}
        for path in self.req.response_fields:
            value: Any = body
            for part in path.split("/"):
                if not isinstance(value, dict) or part not in value:
                    break
                value = value[part]
            else:
                out[path.split("/")[-1]] = value
        return out

    # ---- whole replies and streams --------------------------------------------------------------

    async def collect(self) -> list[dict[str, Any]]:
        async for d in self.gen.deltas():
            self.feed(d)
        return [self.result(i) for i in range(len(self.choices))]

    async def events(self) -> AsyncIterator[bytes]:
        """Partial results while the text arrives, then each choice's final result; an error mid-stream is the last
        event (`{"error": ...}`)."""
        try:
            async for d in self.gen.deltas():
                c = self.choices[d.index]
                before = len(c.probs)
                text, ended = self.feed(d)
                if ended:
                    yield _event(self.result(d.index, last=(text, list(d.token_ids))))
                elif text or d.token_ids:
                    yield _event(self.partial(d.index, text, list(d.token_ids), c.probs[before:]))
                if ended and all(c.stop_type is not None for c in self.choices):
                    return
        except Exception as exc:  # noqa: BLE001 - the headers are gone: the error is the last event
            yield _event(error_body(service_error(exc)))


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def _finite(x: float) -> float:
    return x if x > -1e30 else -1e30  # JSON has no -inf


def _per(ms: float, n: int) -> float:
    return ms / n if n else 0.0


def _rate(n: int, ms: float) -> float:
    return n * 1000.0 / ms if ms > 0 else 0.0
