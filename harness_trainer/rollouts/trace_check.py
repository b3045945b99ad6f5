"""OpenEnv's trace validator in a process of its own, so that the pool's GIL does not pay for it.

    python -m harness_trainer.rollouts.trace_check    reads traces on stdin, each after its length (8 bytes, little
                                                       endian), and answers each with what OpenEnv's validator found
                                                       wrong, after its length: 0 when the trace validates

OpenEnv's validator walks every token id in Python (twice the time of reading and sharing the trace); on the pool's
GIL it capped the rollouts a pool finishes at 1,024 in flight (docs/benchmarks.md, "The rollout side at scale")."""

from __future__ import annotations

import importlib.util
import logging
import signal
import struct
import subprocess
import sys
import threading
import types
from pathlib import Path

from harness_trainer import fastjson
from harness_trainer.traces.compact import expand

HEADER = struct.Struct("<Q")
COMPACT_START = b'{"form":"compact"'  # how the proxy's compact trace begins (proxy/session.py: compact_trace)
log = logging.getLogger("harness_trainer")


def breach(contract, body: bytes) -> str | None:
    """What `contract` (OpenEnv's TrainingTrace) finds wrong with a trace (whole, or compact: made whole first), or
    None."""
    try:
        if body.startswith(COMPACT_START):
            contract.model_validate(expand(fastjson.loads(body)))
        else:
            contract.model_validate_json(body)
    except ValueError as exc:
        return str(exc)
    return None


class Checker:
    """The checker process, started on first use and again after it died (killed, out of memory). One check at a
    time: a check is ~50 ms of a 2 MB trace, its reading on the pool's thread as long. A check the dead process was
    given is done on the caller's thread instead: no trace goes unchecked."""

    def __init__(self, contract) -> None:
        self.contract = contract  # OpenEnv's TrainingTrace, for a check done on the caller's thread
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None

    def breach(self, body: bytes) -> str | None:
        with self._lock:
            try:
                return self._ask(body)
            except (OSError, EOFError) as exc:
                log.warning("the trace checker ended (%s, exit %s): this trace is checked in the pool, the next by "
                            "a new checker", exc, self._stop())
        return breach(self.contract, body)

    def _ask(self, body: bytes) -> str | None:
        if self._process is None:  # its stderr is the run's: a traceback there says why it died
            self._process = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE)
        self._process.stdin.write(HEADER.pack(len(body)))
        self._process.stdin.write(body)
        self._process.stdin.flush()
        found = _read(self._process.stdout)
        return found.decode() if found else None

    def _stop(self) -> int | None:
        code = None
        if self._process is not None:
            self._process.kill()
            code = self._process.wait()
            for pipe in (self._process.stdin, self._process.stdout):
                try:
                    pipe.close()
                except OSError:
                    pass
            self._process = None
        return code

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None


def _read(stream) -> bytes:
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        raise EOFError("the trace checker ended")
    (size,) = HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the trace checker ended")
    return data


def _openenv_contract():
    """OpenEnv's TrainingTrace and the validator it calls, imported without their packages' __init__ files: those
    import gradio and the capture server (6 s and 220 MB a process); the model and its validator need pydantic only.
    Each package is entered as an empty module with its real path, so its submodules import as they are."""
    spec = importlib.util.find_spec("openenv")
    root = Path(next(iter(spec.submodule_search_locations)))
    for name in ("openenv", "openenv.core", "openenv.core.harness", "openenv.core.harness.capture"):
        package = types.ModuleType(name)
        package.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
        sys.modules[name] = package
    from openenv.core.harness.capture import validate  # noqa: F401  imported now, not at the first trace
    from openenv.core.harness.training import TrainingTrace
    return TrainingTrace


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the run; it ends this by closing the pipe
    contract = _openenv_contract()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    try:
        while True:
            try:
                body = _read(stdin)
            except EOFError:
                return 0
            found = (breach(contract, body) or "").encode()
            stdout.write(HEADER.pack(len(found)) + found)
            stdout.flush()
    except BrokenPipeError:  # the run ended while a trace was checked
        return 0


if __name__ == "__main__":
    sys.exit(main())
