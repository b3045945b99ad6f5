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
