"""Runs Harbor's terminus-2 inside the sandbox, as any installed agent runs there: Harbor's own agent class, on the
Python of the Harbor environment (`.venv-harbor`, mounted read-only like every agent's runtime), driving a tmux
session in the sandbox it runs in. Harbor runs terminus-2 in its own process against a remote environment; here
that environment is this sandbox itself (`HereEnvironment`: each exec a local `bash -c`), so terminus-2 works in
every sandbox of ours and its model calls leave through the trial's one road out, the capture proxy.

    python terminus_run.py        (everything from the environment: HARNESS_TASK, HARNESS_BASE_URL, HARNESS_MODEL,
                                   HARNESS_MAX_TURNS, OPENAI_API_KEY; writes /logs/agent, or HARNESS_LOGS where
                                   it runs outside a trial, as the recorded runs in tests/agents were made)

Exit 0 when the agent ended on its own (done, or out of turns), 1 when it raised (its error in
/logs/agent/result.json), 127 when the sandbox has no tmux (terminus-2 drives one; Harbor installs it with the
image's package manager, which needs the network a trial does not have).
Standard library and harbor only: this file is written into the sandbox and run there, not imported.
"""

import asyncio
import json
import os
import shutil
import sys
import traceback
from pathlib import Path

LOGS = Path(os.environ.get("HARNESS_LOGS", "/logs/agent"))
CONTEXT = 32768  # the context terminus-2 is told the model has: its summarization starts 8,000 tokens short of it


def here_environment():
    from harbor.environments.base import BaseEnvironment, ExecResult
    from harbor.models.task.config import EnvironmentConfig
    from harbor.models.trial.paths import TrialPaths

    class HereEnvironment(BaseEnvironment):
        """Harbor's environment interface over the sandbox this runs in: commands run here, files copy here."""

        @staticmethod
        def type() -> str:
            return "here"

        def _validate_definition(self):
            pass

        async def start(self, force_build: bool) -> None:
            pass

        async def stop(self, delete: bool):
            pass

        async def exec(self, command, cwd=None, env=None, timeout_sec=None, user=None) -> ExecResult:
            # `user` is not switched: the sandbox already runs the agent as the task's [agent] user
            process = await asyncio.create_subprocess_exec(
                "bash", "-c", command, cwd=cwd or os.getcwd(), env={**os.environ, **(env or {})},
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                start_new_session=True)
            try:
                out, err = await asyncio.wait_for(process.communicate(), timeout_sec)
            except (asyncio.TimeoutError, TimeoutError):
                process.kill()
                await process.wait()
                return ExecResult(stdout="", stderr=f"timed out after {timeout_sec} s", return_code=124)
            return ExecResult(stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"),
                              return_code=process.returncode)

        async def upload_file(self, source_path, target_path):
            Path(target_path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source_path, target_path)

        async def upload_dir(self, source_dir, target_dir):
            shutil.copytree(source_dir, target_dir, dirs_exist_ok=True)

        async def download_file(self, source_path, target_path):
            await self.upload_file(source_path, target_path)

        async def download_dir(self, source_dir, target_dir):
            await self.upload_dir(source_dir, target_dir)

    trial = Path(os.environ.get("TMPDIR", "/tmp")) / "terminus-trial"
    return HereEnvironment(environment_dir=trial, environment_name="here", session_id="here__env",
                           trial_paths=TrialPaths(trial_dir=trial), task_env_config=EnvironmentConfig())


async def run() -> dict:
    from harbor.agents.terminus_2 import Terminus2
    from harbor.models.agent.context import AgentContext

    agent = Terminus2(
        logs_dir=LOGS, model_name=f"openai/{os.environ['HARNESS_MODEL']}", api_base=os.environ["HARNESS_BASE_URL"],
        max_turns=int(os.environ.get("HARNESS_MAX_TURNS", "30")), suppress_max_turns_warning=True,
        record_terminal_session=False,  # asciinema is not in the image and cannot be installed offline
        model_info={"max_input_tokens": CONTEXT, "max_output_tokens": CONTEXT, "input_cost_per_token": 0.0,
                    "output_cost_per_token": 0.0})
    environment = here_environment()
    await agent.setup(environment)
    result = AgentContext()
    await agent.run(os.environ["HARNESS_TASK"], environment, result)
    return {"n_input_tokens": result.n_input_tokens, "n_output_tokens": result.n_output_tokens,
            "metadata": result.metadata}


def main() -> int:
    LOGS.mkdir(parents=True, exist_ok=True)
    if shutil.which("tmux") is None:
        print("terminus-2 needs tmux in the image (it drives a tmux session; Harbor installs it with the image's "
              "package manager, which needs the network): add it to the task's Dockerfile, e.g. "
              "`RUN apt-get install -y tmux`", file=sys.stderr)
        return 127
    try:
        report = asyncio.run(run())
        code = 0
    except Exception as exc:  # the model API or the terminal failed it: said in result.json for the harness
        report = {"error": f"{type(exc).__name__}: {exc}"[:2000], "error_type": type(exc).__name__,
                  "traceback": traceback.format_exc()[-4000:]}
        print(report["error"], file=sys.stderr)
        code = 1
    (LOGS / "result.json").write_text(json.dumps(report, default=str))
    return code


if __name__ == "__main__":
    sys.exit(main())
