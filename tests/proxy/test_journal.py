"""The journal's fsync off the event loop (proxy/store.py): a call written with sync=False is on disk once
`synced` returns, calls finished together share a file's fsync, and a call written while an fsync is under way
waits for the next one. os.fsync is wrapped to count and to hold (a disk cannot be made slow on demand); the
writes and the fsyncs are real. The end to end promise, every turn an agent received survives kill -9, is
test_capture.py's."""

from __future__ import annotations

import asyncio
import json
import os
import threading

from harness_trainer.proxy import store as store_module
from harness_trainer.proxy.session import Call, training_trace
from harness_trainer.proxy.store import SessionStore


def _call(index: int) -> Call:
    return Call(index=index, dialect="chat", stream=False, policy_version=0, n_tools=0,
                request={"messages": [{"role": "user", "content": "hi"}]}, sampling_params={},
                requested_sampling_params={}, prompt_suffix=[1, 2], completion_token_ids=[3],
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


def _turn(index: int, prompt: list[int], completion: list[int], messages: list[dict]) -> Call:
    return Call(index=index, dialect="chat", stream=False, policy_version=0, n_tools=1,
                request={"messages": messages, "tools": [{"type": "function"}]}, sampling_params={},
                requested_sampling_params={}, prompt_suffix=prompt, completion_token_ids=completion,
                per_token_logps=[-0.25] * len(completion), message={"role": "assistant", "content": "x"},
                finish_reason="stop")


def _forked_rollout(store: SessionStore):
    """0 -> 1 -> 2, then 3 forks from 1 (its parent two records back), then 4 rewrites the history (a root)."""
    session = store.create(upstream="http://e", model="tiny", session_id="fork")
    system = [{"role": "system", "content": "s"}]
    turns = [([1, 2, 3], [10, 11]), ([1, 2, 3, 10, 11, 4], [12]), ([1, 2, 3, 10, 11, 4, 12, 5], [13]),
             ([1, 2, 3, 10, 11, 4, 12, 6, 6], [14]), ([1, 9], [15])]
    for k, (prompt, completion) in enumerate(turns):
        store.record(session, _turn(k, prompt, completion, system + [{"role": "user", "content": f"{j}"}
                                                                      for j in range(k + 1)]))
    return session, turns


def _same_calls(reloaded, recorded) -> None:
    assert len(reloaded.calls) == len(recorded)
    for again, call in zip(reloaded.calls, recorded):
        assert list(again.prompt_token_ids) == list(call.prompt_token_ids)
        assert again.request == call.request and (again.base and again.base.index) == (call.base and call.base.index)


def test_calls_are_journaled_as_what_they_add_to_their_parent_and_reload_exactly(tmp_path):
    store = SessionStore(tmp_path)
    session, turns = _forked_rollout(store)
    records = [json.loads(line) for line in (tmp_path / "fork.jsonl").read_text().splitlines()][1:]
    assert [r["base"] for r in records] == [None, 0, 1, 1, None]
    assert [r["prompt_suffix"] for r in records] == [[1, 2, 3], [4], [5], [6, 6], [1, 9]]
    assert records[2]["request"]["extends"] == 3 and len(records[2]["request"]["messages"]) == 1
    assert records[2]["request"]["same_tools"] is True and "tools" not in records[2]["request"]
    assert [list(c.prompt_token_ids) for c in session.calls] == [prompt for prompt, _ in turns]
    _same_calls(SessionStore(tmp_path).sessions["fork"], session.calls)
    assert training_trace(SessionStore(tmp_path).sessions["fork"]) == training_trace(session)


def test_a_torn_last_delta_record_is_skipped_and_the_rest_kept(tmp_path):
    store = SessionStore(tmp_path)
    session, _ = _forked_rollout(store)
    path = tmp_path / "fork.jsonl"
    path.write_bytes(path.read_bytes()[:-20])  # killed in the middle of writing call 4
    _same_calls(SessionStore(tmp_path).sessions["fork"], session.calls[:4])


def test_a_record_whose_parent_is_missing_ends_the_reading_there_and_says_so(tmp_path, capsys):
    store = SessionStore(tmp_path)
    session, _ = _forked_rollout(store)
    path = tmp_path / "fork.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:2] + lines[3:]))  # call 1 lost: call 2 (now the second) continues it
    reloaded = SessionStore(tmp_path).sessions["fork"]
    _same_calls(reloaded, session.calls[:1])
    assert "continues call 1, which is not in the journal" in capsys.readouterr().err


def test_a_journal_of_whole_calls_from_before_still_reloads(tmp_path):
    """Journals written before calls were stored as suffixes: each call whole, no base."""
    (tmp_path / "old.jsonl").write_text(
        json.dumps({"t": "session", "id": "old", "upstream": "http://e", "model": "tiny", "policy": {}}) + "\n"
        + "".join(json.dumps({"t": "call", **{k: v for k, v in vars(_turn(k, p, c, [])).items()
                                            if k not in ("base", "prompt_key", "prompt_tokens", "prompt_suffix")},
                              "per_token_logps": [-0.25] * len(c), "prompt_token_ids": p,
                              "completion_token_ids": c}) + "\n"
                  for k, (p, c) in enumerate([([1, 2], [3]), ([1, 2, 3, 4], [5])])))
    reloaded = SessionStore(tmp_path).sessions["old"]
    assert [list(c.prompt_token_ids) for c in reloaded.calls] == [[1, 2], [1, 2, 3, 4]]
    assert reloaded.calls[1].base is reloaded.calls[0] and list(reloaded.calls[1].prompt_suffix) == [4]
