"""The journal (proxy/store.py): every record written at once, fsynced by `sync_all` in one thread off the event
loop, each file once per round, and a record written while a round is under way waits for the next; calls stored
as what they add to their prefix parent and rebuilt exactly on reload. os.fsync is wrapped to count, hold or fail
(a disk cannot be made slow or broken on demand); the writes and the fsyncs are real. The end to end promise,
every turn an agent received survives kill -9, is test_capture.py's and test_long_rollouts.py's."""

from __future__ import annotations

import asyncio
import json
import os
import threading

from harness_trainer.proxy import store as store_module
from harness_trainer.proxy.session import Call, training_trace
from harness_trainer.proxy.store import SessionStore, unpacked


def _call(index: int) -> Call:
    return Call(index=index, dialect="chat", stream=False, policy_version=0, n_tools=0,
                request={"messages": [{"role": "user", "content": "hi"}]}, sampling_params={},
                requested_sampling_params={}, prompt_suffix=[1, 2], completion_token_ids=[3],
                per_token_logps=[-0.5], message={"role": "assistant", "content": "x"}, finish_reason="stop")


def _counting_fsync(monkeypatch, hold: threading.Event | None = None, fail: int = 0):
    calls, entered, real = [], threading.Event(), os.fsync

    def fsync(fd):
        calls.append(fd)
        entered.set()
        if hold is not None:
            hold.wait(60)  # only a test that never releases it would wait this long
        if len(calls) <= fail:
            raise OSError(5, "Input/output error")
        real(fd)

    monkeypatch.setattr(store_module.os, "fsync", fsync)
    return calls, entered


def test_records_are_written_at_once_and_fsynced_once_per_file_a_round(tmp_path, monkeypatch):
    store = SessionStore(tmp_path)
    sessions = [store.create(upstream="http://e", model="tiny") for _ in range(3)]
    calls, _ = _counting_fsync(monkeypatch)
    for session in sessions:
        store.record(session, _call(0))
        store.record(session, _call(1))
    assert store.unsynced == {s.id for s in sessions} and calls == []
    assert [len(s.calls) for s in SessionStore(tmp_path).sessions.values()] == [2, 2, 2]  # written: a kill keeps them
    asyncio.run(store.sync_all())
    assert len(calls) == 3 and store.unsynced == set()
    asyncio.run(store.sync_all())  # nothing new written: nothing synced
    assert len(calls) == 3


def test_a_record_written_during_a_round_waits_for_the_next(tmp_path, monkeypatch):
    store = SessionStore(tmp_path)
    session = store.create(upstream="http://e", model="tiny")
    hold = threading.Event()
    calls, entered = _counting_fsync(monkeypatch, hold)

    async def scenario():
        first = asyncio.create_task(store.sync_all())
        await asyncio.to_thread(entered.wait, 60)  # the round's fsync is under way (and held)
        store.record(session, _call(0))  # written after it began: not covered by it
        assert store.unsynced == {session.id}
        hold.set()
        await first
        await store.sync_all()
        return len(calls)

    assert asyncio.run(scenario()) == 2
    assert store.unsynced == set()


def test_a_failed_fsync_is_said_and_its_files_synced_in_the_next_round(tmp_path, monkeypatch, capsys):
    """keep_synced runs for the proxy's life: a disk error must not end it, nor drop the files it was syncing."""
    store = SessionStore(tmp_path)
    session = store.create(upstream="http://e", model="tiny")
    calls, _ = _counting_fsync(monkeypatch, fail=1)

    rounds, sync_all = [], store.sync_all

    async def counted():
        try:
            await sync_all()
        finally:
            rounds.append(len(calls))

    store.sync_all = counted

    async def scenario():
        keeper = asyncio.create_task(store.keep_synced(every_s=0))
        while len(rounds) < 2:  # the failed round, then the next one, which syncs the same file
            await asyncio.sleep(0)
        keeper.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 60))  # a bound for a stuck loop only: the rounds take milliseconds
    assert len(calls) == 2 and session.id not in store.unsynced
    assert "the journal could not be synced to disk" in capsys.readouterr().err


def _turn(index: int, prompt: list[int], completion: list[int], messages: list[dict]) -> Call:
    return Call(index=index, dialect="chat", stream=False, policy_version=0, n_tools=1,
                request={"messages": messages, "tools": [{"type": "function"}]}, sampling_params={},
                requested_sampling_params={}, prompt_suffix=prompt, completion_token_ids=completion,
                per_token_logps=[-0.25] * len(completion), message={"role": "assistant", "content": "x"},
                finish_reason="stop")


def _forked_rollout(store: SessionStore):
    """0 -> 1 -> 2, then 3 forks from 1 (its parent two records back), then 4 rewrites the history (a root), then
    5 resends 4's prompt with more (a retry: no parent, it repeats 4's prompt)."""
    session = store.create(upstream="http://e", model="tiny", session_id="fork")
    system = [{"role": "system", "content": "s"}]
    turns = [([1, 2, 3], [10, 11]), ([1, 2, 3, 10, 11, 4], [12]), ([1, 2, 3, 10, 11, 4, 12, 5], [13]),
             ([1, 2, 3, 10, 11, 4, 12, 6, 6], [14]), ([1, 9], [15]), ([1, 9, 7], [16])]
    for k, (prompt, completion) in enumerate(turns):
        store.record(session, _turn(k, prompt, completion, system + [{"role": "user", "content": f"{j}"}
                                                                      for j in range(k + 1)]))
    return session, turns


def _same_calls(reloaded, recorded) -> None:
    assert len(reloaded.calls) == len(recorded)
    for again, call in zip(reloaded.calls, recorded):
        assert list(again.prompt_token_ids) == list(call.prompt_token_ids)
        assert again.request == call.request and (again.base and again.base.index) == (call.base and call.base.index)
        assert (again.repeats and again.repeats.index) == (call.repeats and call.repeats.index)


def test_calls_are_journaled_as_what_they_add_to_their_parent_and_reload_exactly(tmp_path):
    store = SessionStore(tmp_path)
    session, turns = _forked_rollout(store)
    records = [unpacked(json.loads(line)) for line in (tmp_path / "fork.jsonl").read_text().splitlines()][1:]
    assert [r["base"] for r in records] == [None, 0, 1, 1, None, None]
    assert [r.get("repeats") for r in records] == [None] * 5 + [4]
    assert [r["prompt_suffix"].tolist() for r in records] == [[1, 2, 3], [4], [5], [6, 6], [1, 9], [7]]
    assert records[5]["request"]["extends"] == 6 and len(records[5]["request"]["messages"]) == 1
    assert records[2]["request"]["extends"] == 3 and len(records[2]["request"]["messages"]) == 1
    assert records[2]["request"]["same_tools"] is True and "tools" not in records[2]["request"]
    assert [list(c.prompt_token_ids) for c in session.calls] == [prompt for prompt, _ in turns]
    _same_calls(SessionStore(tmp_path).sessions["fork"], session.calls)
    assert training_trace(SessionStore(tmp_path).sessions["fork"]) == training_trace(session)


def test_a_torn_last_delta_record_is_skipped_and_the_rest_kept(tmp_path):
    store = SessionStore(tmp_path)
    session, _ = _forked_rollout(store)
    path = tmp_path / "fork.jsonl"
    path.write_bytes(path.read_bytes()[:-20])  # killed in the middle of writing call 5
    _same_calls(SessionStore(tmp_path).sessions["fork"], session.calls[:5])


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


def test_a_record_whose_ids_cannot_be_read_ends_the_reading_there_and_says_so(tmp_path, capsys):
    store = SessionStore(tmp_path)
    session, _ = _forked_rollout(store)
    path = tmp_path / "fork.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    broken = json.loads(lines[3])
    broken["prompt_suffix"] = "not base64!"
    path.write_text("".join(lines[:3] + [json.dumps(broken) + "\n"] + lines[4:]))
    _same_calls(SessionStore(tmp_path).sessions["fork"], session.calls[:2])
    assert "has ids that are not base64" in capsys.readouterr().err
