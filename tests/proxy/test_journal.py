"""The journal's fsync off the event loop (proxy/store.py): a call written with sync=False is on disk once
`synced` returns, calls finished together share a file's fsync, and a call written while an fsync is under way
waits for the next one. os.fsync is wrapped to count and to hold (a disk cannot be made slow on demand); the
writes and the fsyncs are real. The end to end promise, every turn an agent received survives kill -9, is
test_capture.py's."""

from __future__ import annotations

import asyncio
import os
import threading

from harness_trainer.proxy import store as store_module
from harness_trainer.proxy.session import Call
from harness_trainer.proxy.store import SessionStore


def _call(index: int) -> Call:
    return Call(index=index, dialect="chat", stream=False, policy_version=0, n_tools=0,
                request={"messages": [{"role": "user", "content": "hi"}]}, sampling_params={},
                requested_sampling_params={}, prompt_token_ids=[1, 2], completion_token_ids=[3],
                per_token_logps=[-0.5], message={"role": "assistant", "content": "x"}, finish_reason="stop")


def _counting_fsync(monkeypatch, hold: threading.Event | None = None):
    calls, entered, real = [], threading.Event(), os.fsync

    def fsync(fd):
        calls.append(fd)
        entered.set()
        if hold is not None:
            hold.wait(60)  # only a test that never releases it would wait this long
        real(fd)

    monkeypatch.setattr(store_module.os, "fsync", fsync)
    return calls, entered


def test_deferred_records_are_fsynced_once_per_file_and_reload(tmp_path, monkeypatch):
    store = SessionStore(tmp_path)
    sessions = [store.create(upstream="http://e", model="tiny") for _ in range(3)]
    calls, _ = _counting_fsync(monkeypatch)
    for session in sessions:
        store.record(session, _call(0), sync=False)
        store.record(session, _call(1), sync=False)
    assert store.unsynced == {s.id for s in sessions} and calls == []

    async def answer_all():
        await asyncio.gather(*(store.synced(s) for s in sessions for _ in range(2)))

    asyncio.run(answer_all())
    assert len(calls) == 3 and store.unsynced == set()
    assert [len(s.calls) for s in SessionStore(tmp_path).sessions.values()] == [2, 2, 2]


def test_a_record_written_during_an_fsync_waits_for_the_next(tmp_path, monkeypatch):
    store = SessionStore(tmp_path)
    session = store.create(upstream="http://e", model="tiny")
    hold = threading.Event()
    calls, entered = _counting_fsync(monkeypatch, hold)

    async def scenario():
        store.record(session, _call(0), sync=False)
        first = asyncio.create_task(store.synced(session))
        await asyncio.to_thread(entered.wait, 60)  # the first fsync is under way (and held)
        store.record(session, _call(1), sync=False)  # written after it began: not covered by it
        second = asyncio.create_task(store.synced(session))
        await asyncio.sleep(0)
        hold.set()
        await first
        await second
        return len(calls)

    assert asyncio.run(scenario()) == 2
    assert store.unsynced == set()


def test_a_finished_fsync_whose_callbacks_have_not_run_does_not_hang_the_loop(tmp_path):
    """The state a waiter can find when the fsync's future finished in the same turn of the loop, before its done
    callbacks ran: `synced` must return (it spun forever, and the proxy with it: found by the fuzzer beside a CPU
    hog). The state is built directly; the loop runs in a thread so that a spin fails the test instead of it."""
    store = SessionStore(tmp_path)
    session = store.create(upstream="http://engine", model="tiny", session_id="s1", sync=False)
    returned = threading.Event()

    async def scenario():
        loop = asyncio.get_running_loop()
        finished = loop.create_future()
        finished.set_result(None)  # done; the callback that would forget it never runs (none was added)
        store.unsynced.discard(session.id)
        store._syncing[session.id] = finished
        await store.synced(session)
        returned.set()
        store.record(session, _call(0), sync=False)  # and the next write is synced by a new fsync
        await store.synced(session)
        assert session.id not in store.unsynced and session.id not in store._syncing

    thread = threading.Thread(target=asyncio.run, args=(scenario(),), daemon=True)
    thread.start()
    thread.join(60)  # a bound for a spinning loop only: the scenario itself takes milliseconds
    assert returned.is_set() and not thread.is_alive()
    assert [line for line in (tmp_path / "s1.jsonl").read_text().splitlines() if '"call"' in line]
