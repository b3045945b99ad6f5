"""Session store with an append-only journal per session, so a restarted proxy loses no finished turn.

journal/<session id>.jsonl holds one JSON record a line:
  {"t": "session", ...}               created (the session's settings)
  {"t": "call", ...}                  one finished model call, written before the agent gets the answer's last
                                      byte, as what it adds to its prefix parent: "base" (the parent's index, an
                                      earlier record's), "prompt_suffix" (the prompt's ids after the parent's
                                      prompt+completion) and "request" as traces/compact.py writes a turn's (the
                                      messages after the parent's); a root has no base and its whole prompt,
                                      or "repeats" (the index of a call whose whole prompt its prompt starts
                                      with: a retry) and the ids and messages after that call's.
                                      Its ids and logprobs are their arrays' bytes in base64 (PACKED; `unpacked`
                                      reads them): a JSON list cost the proxy 2 ms of a 51k-id call to write
  {"t": "version", "policy_version", "model"}  the trainer moved the session to a new policy version
  {"t": "upstream", "upstream"}       its engine was lost before its first call: pinned to another
  {"t": "stop", "why"}                a clean stop the proxy answered
A torn last line (a kill -9 during a write) is skipped on reload; everything before it is kept. A record that
cannot be rebuilt (its parent missing) ends the file's reading there, said in the proxy's log.

What the journal promises (docs/design/proxy.md, "Nothing lost"): a record is written (the kernel has it) before it is
acknowledged (the answer's last byte, a session's key, a policy version's 200), so a proxy killed at any point -
kill -9, out of memory, a crash - loses nothing it acknowledged. Surviving the machine itself (power, a kernel
panic) is the disk's part: every written file is fsynced within FSYNC_EVERY_S, off the event loop, in one
thread. A machine that dies takes the rollouts' sandboxes and agents with it, so those rollouts start again
anyway; an fsync per call before its answer (2.4 ms measured here) bought nothing more and cost each call that.
journal/policy.json holds the trainer's latest version and model (POST /policy_version), replaced atomically, so
a restarted proxy stamps new sessions as the trainer left it, even with no session alive.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import secrets
import sys
from array import array
from dataclasses import asdict
from pathlib import Path

from harness_trainer import fastjson
from harness_trainer.proxy.capture import SamplingPolicy
from harness_trainer.proxy.session import SESSION_ID, Call, Session, captured, request_delta
from harness_trainer.traces.compact import whole_request

# journaled as they happen, or derived; engine_failure is not kept across a restart of the proxy
NOT_JOURNALED = ("calls", "started_calls", "stops", "shared", "graph_of", "engine_failure", "prefixes",
                 "prompts", "last_messages", "last_request", "ids_text")
FSYNC_EVERY_S = 1.0  # the most a machine's crash can lose of what was written


class Unreadable(Exception):
    """A journal record that cannot be rebuilt (not a torn line: a record whose parent is not in the file)."""


class SessionStore:
    def __init__(self, journal_dir: str | Path | None = None):
        self.sessions: dict[str, Session] = {}
        self.current_version = 0  # the trainer's latest policy version (POST /policy_version)
        self.current_model: str | None = None  # the model name new calls go to (a LoRA adapter), if not the served
        self.in_flight: dict[str, int] = {}  # model name -> calls sent upstream and not yet answered
        self.journal_dir = Path(journal_dir) if journal_dir else None
        self.unsynced: set[str] = set()  # sessions whose journal has writes not yet fsynced
        if self.journal_dir:
            self.journal_dir.mkdir(parents=True, exist_ok=True)
            self._reload()

    def _append(self, session_id: str, record: dict, arrays: dict[str, bytes] | None = None) -> None:
        """Written now (what the journal promises); fsynced by the next `sync_all`. `arrays`: fields whose values
        are base64 (`packed`), written into the record as strings without being read again (a 51k-id prompt's
        270 KB was a tenth of a 200 KB call's time as a str encoded and escaped)."""
        if not self.journal_dir:
            return
        line = fastjson.dumps(record)
        if arrays:
            line = line[:-1] + b"".join(b',"%s":"%s"' % (k.encode(), v) for k, v in arrays.items()) + b"}"
        line += b"\n"
        fd = os.open(self.journal_dir / f"{session_id}.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        self.unsynced.add(session_id)

    def _fsync(self, session_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):  # deleted meanwhile: nothing left to keep
            fd = os.open(self.journal_dir / f"{session_id}.jsonl", os.O_RDONLY)
            try:
                os.fsync(fd)  # any descriptor of the file: fsync writes the file's data, whoever wrote it
            finally:
                os.close(fd)

    async def keep_synced(self, every_s: float = FSYNC_EVERY_S) -> None:
        """Runs for the proxy's life: what was written is fsynced within `every_s`, the files one after another
        in one thread (1,024 sessions' fsyncs at once would be 1,024 threads' worth of the loop's executor)."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.sync_all()
            except OSError as exc:  # the disk failed: said, and its files tried again next round
                print(f"capture proxy: the journal could not be synced to disk ({exc}); trying again",
                      file=sys.stderr, flush=True)

    async def sync_all(self) -> None:
        """Everything written so far is on disk once this returns; what is written meanwhile waits for the next."""
        if self.unsynced and self.journal_dir:
            written, self.unsynced = self.unsynced, set()
            try:
                await asyncio.to_thread(lambda: [self._fsync(sid) for sid in sorted(written)])
            except BaseException:
                self.unsynced |= written  # not known to be on disk
                raise

    def set_current(self, version: int, model: str | None) -> None:
        """The version (and model) sessions minted from now on start at."""
        self.current_version, self.current_model = version, model
        if self.journal_dir:
            staging = self.journal_dir / "policy.json.tmp"
            staging.write_text(json.dumps({"policy_version": version, "model": model}))
            os.replace(staging, self.journal_dir / "policy.json")

    def _reload(self) -> None:
        if (saved := self.journal_dir / "policy.json").exists():
            try:
                state = json.loads(saved.read_text())
                self.current_version, self.current_model = int(state["policy_version"]), state.get("model")
            except (ValueError, KeyError, TypeError):
                pass  # unreadable: the sessions' own versions below still say where the trainer was
        for path in sorted(self.journal_dir.glob("*.jsonl")):
            session = None
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    record = fastjson.loads(line)
                except json.JSONDecodeError:
                    break  # torn tail
                kind = record.pop("t", None)
                if kind == "session":
                    record["policy"] = SamplingPolicy(**record["policy"])
                    session = Session(**record)
                elif kind == "call" and session:
                    try:
                        session.attach(restored(session, record))
                    except Unreadable as exc:
                        print(f"capture proxy: journal {path.name}: {exc}; the records after it are not read",
                              file=sys.stderr, flush=True)
                        break
                elif kind == "upstream" and session:
                    session.upstream = record["upstream"]
                elif kind == "stop" and session:
                    session.stops.append(record["why"])
                elif kind == "version" and session:
                    session.policy_version = record["policy_version"]
                    session.sampling_model = record.get("model")
                    if session.policy_version >= self.current_version:
                        self.current_version, self.current_model = session.policy_version, session.sampling_model
            if session:
                session.started_calls = len(session.calls)
                self.sessions[session.id] = session

    def create(self, *, upstream: str, model: str, session_id: str | None = None,
               policy: SamplingPolicy | None = None, max_model_calls: int | None = None,
               policy_version: int = 0, metadata: dict | None = None) -> Session:
        session_id = session_id or "hs-" + secrets.token_urlsafe(18).replace("-", "x").replace("_", "y")
        if not SESSION_ID.match(session_id):
            raise ValueError(f"session id {session_id!r} must match {SESSION_ID.pattern}")
        if session_id in self.sessions:
            raise KeyError(f"session {session_id} already exists")
        session = Session(id=session_id, upstream=upstream.rstrip("/"), model=model,
                          policy=policy or SamplingPolicy(), max_model_calls=max_model_calls,
                          policy_version=policy_version, sampling_model=self.current_model, metadata=metadata or {})
        kept = {k: v for k, v in asdict(session).items() if k not in NOT_JOURNALED}
        self._append(session.id, {"t": "session", **kept})
        self.sessions[session.id] = session
        return session

    def record(self, session: Session, call: Call) -> None:
        """The call joins its session (stored as what it adds to its parent) and is written to its journal."""
        session.attach(call)
        if self.journal_dir:
            base, arrays = call.base, packed(call)
            before = base or call.repeats
            record = {"t": "call", **captured(call), "base": base and base.index, "prompt_suffix": call.prompt_suffix,
                      "request": request_delta(call.request, before and before.request)}
            if call.repeats is not None:
                record["repeats"] = call.repeats.index
            self._append(session.id, {k: v for k, v in record.items() if k not in arrays}, arrays)

    def stop(self, session: Session, why: str) -> None:
        """The proxy answered a clean stop (budget, context): journaled like a call, once per reason."""
        if why not in session.stops:
            session.stops.append(why)
            self._append(session.id, {"t": "stop", "why": why})

    def set_policy_version(self, session: Session, version: int, model: str | None = None) -> None:
        """From now on the session's calls are stamped `version` and sent to `model` (None: its served model)."""
        session.policy_version, session.sampling_model = version, model
        self._append(session.id, {"t": "version", "policy_version": version, "model": session.sampling_model})

    def move(self, session: Session, upstream: str) -> None:
        """Pin a session that has made no call yet to another engine (its own was lost)."""
        session.upstream = upstream
        self._append(session.id, {"t": "upstream", "upstream": upstream})

    def delete(self, session_id: str) -> bool:
        session = self.sessions.pop(session_id, None)
        if session and self.journal_dir:
            (self.journal_dir / f"{session_id}.jsonl").unlink(missing_ok=True)
        return session is not None


PACKED = {"prompt_suffix": "i", "completion_token_ids": "i", "per_token_logps": "d"}  # field -> array typecode


def packed(call: Call) -> dict[str, bytes]:
    """The call's arrays as base64 of their bytes (in this machine's byte order, which reads them back); an engine's
    odd values, kept as a list (the call's `problem` says why), are written as they are."""
    return {k: base64.b64encode(v) for k in PACKED if isinstance(v := getattr(call, k), array)}


def unpacked(record: dict) -> dict:
    """A call record with its packed arrays read back (a list, as older journals and odd values have, as it is)."""
    for key, typecode in PACKED.items():
        if isinstance(record.get(key), str):
            values = array(typecode)
            values.frombytes(base64.b64decode(record[key]))
            record[key] = values
    return record


def _earlier(session: Session, record: dict, key: str) -> Call | None:
    """The earlier call a record names as its `key` ("base", "repeats"; popped), None if it names none."""
    index = record.pop(key, None)
    if index is not None and not (isinstance(index, int) and 0 <= index < len(session.calls)):
        raise Unreadable(f"call {record.get('index')} continues call {index!r}, which is not in the journal")
    return None if index is None else session.calls[index]


def restored(session: Session, record: dict) -> Call:
    """A journaled call as it was recorded: its whole prompt and request rebuilt from its parent's."""
    try:
        record = unpacked(record)
    except ValueError as exc:  # binascii.Error
        raise Unreadable(f"call {record.get('index')} has ids that are not base64 ({exc})") from None
    base, repeats = (_earlier(session, record, key) for key in ("base", "repeats"))
    if "prompt_token_ids" in record:  # a journal written before calls were stored as suffixes: whole
        record["prompt_suffix"], base = record.pop("prompt_token_ids"), None
    try:
        before = base or repeats
        request = whole_request(record.get("request") or {}, before and before.request)
        return Call(**dict(record, request=session.share(request)), base=base, repeats=None if base else repeats)
    except (TypeError, ValueError) as exc:
        raise Unreadable(f"call {record.get('index')} cannot be rebuilt ({exc})") from None
