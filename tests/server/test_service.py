"""Service without HTTP: n-expansion and seeds, all-or-nothing submission, cancellation when the consumer leaves."""
from __future__ import annotations

import asyncio
import threading

import pytest

from slipstream.engine.mock_engine import MockEngine
from slipstream.engine.scheduler import OutputProcessor, Overloaded, Scheduler
from slipstream.server.protocol import ChatCompletionRequest, CompletionRequest
from slipstream.server.errors import ServiceError
from slipstream.server.openai_api import prepare_chat, prepare_completion
from slipstream.server.service import Service, ServiceConfig
from tests.server.conftest import EOS, MODEL, ByteTokenizer, wait_for


class RecordingScheduler:
    """Passes submissions to a real scheduler, refusing the k-th one as a full queue would."""

    def __init__(self, inner: Scheduler, refuse_at: int | None = None) -> None:
        self.inner, self.refuse_at, self.requests = inner, refuse_at, []

    def submit(self, request):
        if len(self.requests) == self.refuse_at:
            raise Overloaded("queue full", retry_after_s=2.5)
        self.requests.append(request)
        return self.inner.submit(request)

    def __getattr__(self, name):
        return getattr(self.inner, name)


ENGINE_ARGS = {"vocab_size": ByteTokenizer.vocab_size, "eos_token_ids": frozenset({EOS}), "step_sleep_s": 0.005}


@pytest.fixture
def scheduler():
    sched = Scheduler(MockEngine(**ENGINE_ARGS), OutputProcessor(ByteTokenizer()))
    sched.start()
    yield sched
    sched.shutdown(timeout=2)


def _service(scheduler, **kwargs) -> Service:
    # The engine is only asked for max_seq_len and compile_count here.
    return Service(scheduler, MockEngine(**ENGINE_ARGS), ByteTokenizer(), ServiceConfig(model_name=MODEL, **kwargs))


def test_n_expands_into_requests_with_consecutive_seeds(scheduler) -> None:
    recorder = RecordingScheduler(scheduler)
    service = _service(recorder)

    async def run():
        gen = service.submit(prepare_completion(service, CompletionRequest(prompt="abc", n=3, seed=41, max_tokens=2)))
        return gen, await gen.collect()

    gen, choices = asyncio.run(run())
    assert [r.params.seed for r in recorder.requests] == [41, 42, 43]
    assert all(r.params.n == 1 for r in recorder.requests)
    assert [r.request_id for r in recorder.requests] == [f"{gen.id}-{i}" for i in range(3)]
    assert [c.text for c in choices] == ["de"] * 3
    assert (gen.prompt_tokens, gen.completion_tokens) == (4, 6)


def test_a_refused_sub_request_cancels_the_admitted_ones(scheduler) -> None:
    service = _service(RecordingScheduler(scheduler, refuse_at=2))
    prepared = prepare_completion(service, CompletionRequest(prompt="abc", n=4, max_tokens=50))

    async def run():
        with pytest.raises(ServiceError) as info:
            service.submit(prepared)
        return info.value

    error = asyncio.run(run())
    assert error.status == 429 and error.retry_after_s == 2.5
    assert wait_for(lambda: scheduler.stats().running == 0 and scheduler.stats().waiting == 0, timeout=1.0)
    assert scheduler.stats().cancellations == 2


def test_leaving_the_stream_early_cancels_every_choice(scheduler) -> None:
    service = _service(scheduler)

    async def run():
        gen = service.submit(prepare_completion(service, CompletionRequest(prompt="a", n=2, max_tokens=100)))
        deltas = gen.deltas()
        first = await deltas.__anext__()
        await deltas.aclose()  # what a disconnecting client amounts to
        return first

    assert asyncio.run(run()).text
    assert wait_for(lambda: scheduler.stats().slots_used == 0, timeout=1.0)
    assert scheduler.stats().cancellations == 2


def test_draining_refuses_new_work_and_unready(scheduler) -> None:
    service = _service(scheduler)
    assert service.ready
    service.begin_drain()
    assert not service.ready
    with pytest.raises(ServiceError) as info:
        service.submit(prepare_completion(service, CompletionRequest(prompt="a")))
    assert (info.value.status, info.value.code) == (503, "shutting_down")


def test_max_choices_limits_prompts_times_n(scheduler) -> None:
    service = _service(scheduler, max_choices=4)
    with pytest.raises(ServiceError) as info:
        service.submit(prepare_completion(service, CompletionRequest(prompt=["a", "b", "c"], n=2)))
    assert info.value.status == 400 and info.value.param == "n" and "4" in info.value.message


def test_chat_template_renders_text_parts_without_bos(scheduler) -> None:
    service = _service(scheduler)
    prepared = prepare_chat(service, ChatCompletionRequest(
        messages=[{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}],
        max_tokens=1))
    assert prepared.prompts == [list(b"<user>hi\n<assistant>")]
    assert prepared.prompt_param == "messages"


def test_start_prepares_and_submits_off_the_loop(scheduler) -> None:
    service = _service(scheduler)
    loop_thread = []

    def prepare():
        loop_thread.append(asyncio.get_running_loop() if _has_loop() else None)
        return prepare_completion(service, CompletionRequest(prompt="abc", max_tokens=3))

    async def run():
        gen = await service.start(prepare, "addr:1")
        return await gen.collect()

    assert [c.text for c in asyncio.run(run())] == ["def"]
    assert loop_thread == [None]  # ran on a worker thread, where no event loop runs


def _has_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def test_start_refusals_reach_the_caller(scheduler) -> None:
    service = _service(scheduler, max_choices=4)

    async def run():
        await service.start(lambda: prepare_completion(service, CompletionRequest(prompt=["a", "b", "c"], n=2)))

    with pytest.raises(ServiceError) as info:
        asyncio.run(run())
    assert info.value.status == 400 and info.value.param == "n"


def test_a_caller_cancelled_during_start_cancels_its_generation(scheduler) -> None:
    # The request is submitted on the worker thread after its caller went away (a client gone, a server
    # stopping): nobody will read it, so it must not run to max_tokens nor keep its client's place.
    service = _service(scheduler, max_requests_per_client=1)
    entered, release = threading.Event(), threading.Event()

    def slow_prepare():
        entered.set()
        release.wait(5)
        return prepare_completion(service, CompletionRequest(prompt="a", max_tokens=100))

    async def run():
        task = asyncio.ensure_future(service.start(slow_prepare, "addr:1"))
        await asyncio.to_thread(entered.wait, 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        assert await asyncio.to_thread(wait_for, lambda: scheduler.stats().cancellations == 1, 2.0)
        # the client's one place is free again
        gen = await service.start(lambda: prepare_completion(service, CompletionRequest(prompt="b", max_tokens=2)),
                                  "addr:1")
        return await gen.collect()

    assert [c.text for c in asyncio.run(run())] == ["cd"]
    assert wait_for(lambda: scheduler.stats().running == 0, timeout=1.0)
