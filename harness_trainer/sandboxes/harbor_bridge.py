"""Runs inside the Harbor environment (`.venv-harbor`, Python >= 3.12 with the `harbor` package) and drives
one of Harbor's environment backends for the trainer's `HarborSandbox`, one JSON request a line on stdin,
one JSON answer a line on stdout:

    {"op": "start", "type": "docker"|"modal"|..., "environment_dir": ..., "name": ..., "trial_dir": ...}
    {"op": "exec", "command": ..., "timeout_s": ..., "env": {...}}  -> {"returncode", "stdout", "stderr", "timed_out"}
    {"op": "upload", "src": ..., "dst": ...}   {"op": "download", "src": ..., "dst": ...}   {"op": "stop"}

Every answer carries "ok"; a failure answers {"ok": false, "error": "..."} and the bridge keeps serving.
Standard library and harbor only: this file is run by path, not imported by the trainer.
"""

import asyncio
import json
import sys
import uuid
from pathlib import Path


async def serve() -> None:
    from harbor.environments.factory import EnvironmentFactory
    from harbor.models.environment_type import EnvironmentType
    from harbor.models.task.config import EnvironmentConfig
    from harbor.models.trial.paths import TrialPaths

    env = None
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        request = json.loads(line)
        op = request.get("op")
        try:
            if op == "start":
                paths = TrialPaths(trial_dir=Path(request["trial_dir"]))
                paths.mkdir()
                kind = request["type"]
                create = EnvironmentFactory.create_environment_from_import_path if ":" in kind else None
                kwargs = dict(environment_dir=Path(request["environment_dir"]), environment_name=request["name"],
                              session_id=f"{request['name']}__{uuid.uuid4().hex[:8]}__env", trial_paths=paths,
                              task_env_config=EnvironmentConfig())
                env = create(kind, **kwargs) if create else \
                    EnvironmentFactory.create_environment(EnvironmentType(kind), **kwargs)
                await env.start(force_build=False)
                answer = {}
            elif op == "exec":
                try:
                    result = await asyncio.wait_for(
                        env.exec(request["command"], cwd="/app", env=request.get("env") or None,
                                 timeout_sec=int(request["timeout_s"])), request["timeout_s"] + 30)
                    answer = {"returncode": result.return_code, "stdout": result.stdout or "",
                              "stderr": result.stderr or "", "timed_out": False}
                except (asyncio.TimeoutError, TimeoutError):
                    answer = {"returncode": -9, "stdout": "", "stderr": "", "timed_out": True}
            elif op == "upload":
                src = Path(request["src"])
                await (env.upload_dir(src, request["dst"]) if src.is_dir() else env.upload_file(src, request["dst"]))
                answer = {}
            elif op == "download":
                await env.download_file(request["src"], Path(request["dst"]))
                answer = {}
            elif op == "stop":
                if env is not None:
                    await env.stop(delete=True)
                answer = {}
            else:
                raise ValueError(f"unknown op {op!r}")
            print(json.dumps({"ok": True, **answer}), flush=True)
        except Exception as exc:  # relayed to the trainer, which turns it into a clear SandboxError
            print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
        if op == "stop":
            break


if __name__ == "__main__":
    asyncio.run(serve())
