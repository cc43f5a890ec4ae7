"""Output side without an engine: UTF-8 safe incremental text, stop strings across token
boundaries, coalescing for slow consumers, the asyncio bridge and per-request metrics."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import NamedTuple

import pytest

from slipstream.engine.output import Emit, OutputProcessor, RequestMetrics
from slipstream.engine.request_stream import RequestStream
from slipstream.engine.request import FinishReason, Request, SamplingParams, TokenLogprob


class ByteTokenizer:
    eos_token_ids = frozenset()

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class WordTokenizer:
    """Tokens are whole strings, so one token can hold several characters of a stop string."""

    WORDS = ["hello", " wor", "ld", "!", " STOP", "here"]
    eos_token_ids = frozenset()

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.WORDS[i] for i in ids)


_keys = itertools.count()


def utf8(text: str) -> list[int]:
    return list(text.encode("utf-8"))


@contextlib.contextmanager
def processor(tokenizer=None):
    released: list[str] = []
    finished: list[RequestMetrics] = []
    out = OutputProcessor(tokenizer or ByteTokenizer())
    out.start(released.append, finished.append)
    try:
        yield out, released, finished
    finally:
        out.close(timeout=5)


class Opened(NamedTuple):
    """A request as the scheduler opens it: the key its Emits carry, its stream."""
    key: int
    stream: RequestStream
    request: Request


def open_stream(out: OutputProcessor, stop: tuple[str, ...] = (), logprobs: int | None = None):
    request = Request(prompt_ids=[1, 2, 3],
                      params=SamplingParams(max_tokens=100, stop=stop, logprobs=logprobs))
    cancelled: list[str] = []
    key = next(_keys)
    return Opened(key, out.open(request, key, cancelled.append), request), cancelled


def feed(out: OutputProcessor, tracker, ids: list[int], finish: FinishReason | None = None) -> None:
    """One record per token, like one decode step each; `finish` rides on the last one."""
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        out.put([Emit(tracker.key, (token,), finish_reason=finish if last else None)])


async def collect(stream):
    return [d async for d in stream]


def stream_deltas(out, tracker, ids, finish=FinishReason.LENGTH):
    async def run():
        feed(out, tracker, ids, finish)
        return await asyncio.wait_for(collect(tracker.stream), 5)
    return asyncio.run(run())


@pytest.mark.parametrize("text", ["héllo", "price: 5€", "smile 😀 ok", "中文字"])
def test_multibyte_characters_never_come_out_broken(text):
    with processor() as (out, _, _):
        tracker, _ = open_stream(out)
        deltas = stream_deltas(out, tracker, utf8(text))
    assert "".join(d.text for d in deltas) == text
    assert all("\ufffd" not in d.text for d in deltas)
    assert [t for d in deltas for t in d.token_ids] == utf8(text)


def test_text_held_for_an_unfinished_character_is_flushed_at_the_end():
    with processor() as (out, _, _):
        tracker, _ = open_stream(out)
        feed(out, tracker, utf8("ok") + [0xE2, 0x82], FinishReason.LENGTH)  # half a "€"
        done = tracker.stream.result(timeout=5)
    assert done.text.startswith("ok") and done.text.endswith("\ufffd")


@pytest.mark.parametrize("text, stop, want", [
    ("abcdefg", ("cde",), "ab"),             # spans three tokens
    ("abcdefg", ("xyz", "bc"), "a"),         # the earliest match wins
    ("ab cdé! more", ("é!",), "ab cd"),      # spans a two-byte character and the next token
    ("aaab", ("aab",), "a"),                 # overlapping partial matches
])
def test_stop_strings_across_token_boundaries_never_leak(text, stop, want):
    with processor() as (out, released, finished):
        tracker, _ = open_stream(out, stop=stop)
        deltas = stream_deltas(out, tracker, utf8(text), finish=None)
        assert released == [tracker.request.request_id]  # the scheduler is told to drop it
    assert "".join(d.text for d in deltas) == want
    assert deltas[-1].finish_reason is FinishReason.STOP
    assert finished[0].finish_reason is FinishReason.STOP


def test_stop_string_inside_and_across_multi_character_tokens():
    with processor(WordTokenizer()) as (out, released, _):
        tracker, _ = open_stream(out, stop=("o w",))
        deltas = stream_deltas(out, tracker, [0, 1, 2], finish=None)
        assert "".join(d.text for d in deltas) == "hell"
        other, _ = open_stream(out, stop=(" ST",))
        done = stream_deltas(out, other, [0, 3, 4, 5], finish=None)
        assert "".join(d.text for d in done) == "hello!"
        assert [t for d in done for t in d.token_ids] == [0, 3, 4]  # through the matching token
        assert len(released) == 2


def test_possible_stop_prefix_is_held_then_released():
    with processor() as (out, released, _):
        tracker, _ = open_stream(out, stop=("cx",))

        async def run():
            feed(out, tracker, utf8("abc"))
            stream, ids, text = tracker.stream, [], ""
            while len(ids) < 3:
                delta = await stream.__anext__()
                ids, text = ids + delta.token_ids, text + delta.text
            assert text == "ab"  # "c" could start "cx": held back
            feed(out, tracker, utf8("cd"), FinishReason.LENGTH)
            return text + "".join([d.text async for d in stream])

        assert asyncio.run(asyncio.wait_for(run(), 5)) == "abccd"
        assert released == []  # the engine finished it: nothing to release
        tail, _ = open_stream(out, stop=("xyz",))
        feed(out, tail, utf8("abxy"), FinishReason.LENGTH)
        assert tail.stream.result(timeout=5).text == "abxy"  # held "xy" is text once it ends


def test_engine_stop_token_is_counted_but_not_shown():
    with processor() as (out, released, _):
        tracker, _ = open_stream(out)
        feed(out, tracker, utf8("hi") + [0], FinishReason.STOP)
        done = tracker.stream.result(timeout=5)
    assert (done.text, done.token_ids) == ("hi", [104, 105, 0])
    assert done.finish_reason is FinishReason.STOP
    assert released == []


def test_slow_consumer_gets_one_merged_delta():
    with processor() as (out, _, _):
        tracker, _ = open_stream(out, logprobs=0)
        text = "the quick brown fox jumps over the lazy dog"
        for token in utf8(text):
            out.put([Emit(tracker.key, (token,), (TokenLogprob(token, -0.5),))])
        out.put([Emit(tracker.key, finish_reason=FinishReason.LENGTH)])
        tracker.stream.result(timeout=5)  # everything produced before anyone reads
        deltas = asyncio.run(collect(tracker.stream))
    assert len(deltas) == 1
    assert deltas[0].text == text and deltas[0].finish_reason is FinishReason.LENGTH
    assert [lp.token_id for lp in deltas[0].logprobs] == utf8(text)


def test_error_record_ends_the_stream_with_the_message():
    with processor() as (out, _, finished):
        tracker, _ = open_stream(out)
        feed(out, tracker, utf8("ab"))
        out.put([Emit(tracker.key, finish_reason=FinishReason.ERROR, error="engine failed: boom")])
        deltas = asyncio.run(asyncio.wait_for(collect(tracker.stream), 5))
        out.put([Emit(tracker.key, (99,))])  # late records for a finished request are ignored
        done = tracker.stream.result(timeout=5)
    assert deltas[-1].error == "engine failed: boom"
    assert deltas[-1].finish_reason is FinishReason.ERROR
    assert done.text == "ab" and done.token_ids == utf8("ab")
    assert [m.finish_reason for m in finished] == [FinishReason.ERROR]


def test_result_times_out_and_cancel_reaches_the_scheduler():
    with processor() as (out, _, _):
        tracker, cancelled = open_stream(out)
        with pytest.raises(TimeoutError):
            tracker.stream.result(timeout=0.05)
        tracker.stream.cancel()
        assert cancelled == [tracker.request.request_id]
        out.put([Emit(tracker.key, finish_reason=FinishReason.CANCELLED)])
        assert tracker.stream.result(timeout=5).finish_reason is FinishReason.CANCELLED


def test_a_closed_event_loop_does_not_break_the_output_thread():
    with processor() as (out, _, _):
        async def make():
            return open_stream(out)[0]  # bound to this loop, which closes right after

        tracker = asyncio.run(make())
        feed(out, tracker, utf8("ok"), FinishReason.LENGTH)
        assert tracker.stream.result(timeout=5).text == "ok"
        assert "".join(d.text for d in asyncio.run(collect(tracker.stream))) == "ok"  # rebinds
        other, _ = open_stream(out)
        feed(out, other, utf8("fine"), FinishReason.LENGTH)
        assert other.stream.result(timeout=5).text == "fine"


def test_broken_listener_does_not_stop_output():
    calls = []

    def bad(metrics):
        calls.append(metrics)
        raise RuntimeError("listener bug")

    out = OutputProcessor(ByteTokenizer())
    out.start(lambda rid: None, bad)
    try:
        for text in ("one", "two"):
            tracker, _ = open_stream(out)
            feed(out, tracker, utf8(text), FinishReason.LENGTH)
            assert tracker.stream.result(timeout=5).text == text
    finally:
        out.close(timeout=5)
    assert [m.output_length for m in calls] == [3, 3]


def test_release_and_metrics_come_before_the_stream_ends():
    """issue 12's flaky test: the release callback and the request's metrics ran after the final
    delta was pushed, so whoever saw the stream end could read them before they happened."""
    seen: list[tuple[str, bool]] = []
    holder: list = []
    out = OutputProcessor(ByteTokenizer())
    out.start(lambda rid: seen.append(("release", holder[0].stream.finished)),
              lambda m: seen.append(("metrics", holder[0].stream.finished)))
    try:
        tracker, _ = open_stream(out, stop=("c",))
        holder.append(tracker)
        feed(out, tracker, utf8("abcd"))
        assert tracker.stream.result(timeout=5).text == "ab"
    finally:
        out.close(timeout=5)
    assert seen == [("release", False), ("metrics", False)]


def test_a_failing_detokenizer_fails_only_its_request_without_leaking_the_exception():
    class Exploding(ByteTokenizer):
        def decode(self, ids, skip_special_tokens: bool = True) -> str:
            if 0xFF in ids:
                raise RuntimeError("secret internal detail")
            return super().decode(ids, skip_special_tokens)

    with processor(Exploding()) as (out, released, finished):
        bad, _ = open_stream(out)
        good, _ = open_stream(out)
        feed(out, bad, [0x61, 0xFF, 0x62], FinishReason.LENGTH)
        feed(out, good, utf8("fine"), FinishReason.LENGTH)
        failed, ok = bad.stream.result(timeout=5), good.stream.result(timeout=5)
        assert released == [bad.request.request_id]  # its slot goes back to the scheduler
    assert failed.finish_reason is FinishReason.ERROR
    assert "secret" not in failed.error and "RuntimeError" not in failed.error
    assert (ok.text, ok.finish_reason) == ("fine", FinishReason.LENGTH)
    assert sorted(m.finish_reason.value for m in finished) == ["error", "length"]


def test_wake_all_wakes_each_event_loop_once():
    """A step's deltas for many streams wake their event loop once, with every stream's callback in order;
    a closed loop does not keep the others from waking."""
    from slipstream.engine.request_stream import wake_all

    class Loop:
        def __init__(self, closed=False):
            self.calls, self.closed = 0, closed

        def call_soon_threadsafe(self, fn, *args):
            if self.closed:
                raise RuntimeError("Event loop is closed")
            self.calls += 1
            fn(*args)

    ran = []
    a, b, gone = Loop(), Loop(), Loop(closed=True)
    wake_all([(a, lambda: ran.append(1)), (gone, lambda: ran.append("x")), (b, lambda: ran.append(2)),
              (a, lambda: ran.append(3))])
    assert (a.calls, b.calls) == (1, 1)
    assert ran == [1, 3, 2]


def test_admitted_waits_for_the_engine_to_take_the_request_up():
    # a streaming response waits on it before its headers: it must return once the engine's admission record
    # arrives, or once a delta or the end does (a request refused at admission never gets the record)
    async def run(out, key, stream, records):
        waiting = asyncio.ensure_future(stream.admitted())
        await asyncio.sleep(0.05)
        early = waiting.done()
        out.put(records)
        await asyncio.wait_for(waiting, 5)
        return early

    with processor() as (out, _, _):
        for records in ([Emit(0, admitted_at=1.0)], [Emit(0, finish_reason=FinishReason.ERROR, error="refused")]):
            opened, _ = open_stream(out)
            records = [Emit(opened.key, **{k: getattr(r, k) for k in ("admitted_at", "finish_reason", "error")})
                       for r in records]
            assert asyncio.run(run(out, opened.key, opened.stream, records)) is False
        # admitted already: returns at once, and the stream's deltas still come
        opened, _ = open_stream(out)
        out.put([Emit(opened.key, admitted_at=1.0)])
        feed(out, opened, utf8("ok"), FinishReason.LENGTH)

        async def admitted_then_deltas():
            await asyncio.wait_for(opened.stream.admitted(), 5)
            return "".join(d.text for d in await collect(opened.stream))
        assert asyncio.run(admitted_then_deltas()) == "ok"
