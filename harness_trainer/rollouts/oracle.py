"""The oracle policy: a scripted OpenAI-compatible upstream that answers each model call with the task's
known solution (solution/solve.sh) as a call to the agent's shell tool (`bash`, claude-code's `Bash`, codex's
`exec_command`, gemini-cli's and qwen-code's `run_shell_command`, cline's `run_commands`), then with the
harness's submit command.

An agent whose own tools refuse to edit a file this session has not read (qwen-code's shell turns a plain `sed -i`
into its edit tool, which does) is answered as a careful solver in it works: `pwd`, then its `read_file` on the file's
absolute path, then the edit (`read_before_edit`). An agent with no tools whose model writes files in the agent's
own format (aider) gets the solution as those file edits (`file_edits`, oracle_edits.py); one whose model types
into a terminal (terminus-2) gets it as keystrokes in the agent's JSON (`keystrokes`, oracle_keystrokes.py).

It sits where vLLM would, behind the same capture proxy, so the pipeline (agent, proxy, sandbox, verifier,
traces) is exercised without a capable model, and its traces are solver demonstrations for SFT. Token ids
are the real engine's: the prompt is tokenised by vLLM's /tokenize, the answer is rendered in the model's
tool-call format and tokenised the same way, and each answer token carries the logprob the served model
gives it (teacher-forced), so traces validate and train like any other.

Teacher forcing is the oracle's cost: vLLM computes prompt logprobs without reading its prefix cache, so every
call prefills its whole context again — about 33 s for a 30k-token context on 2 CPU cores, where a sampled call
that reads the cache takes under a second. A group's rollouts ask the same question until their attempts
differ, so each scored sequence is computed once per weight version (`_score`) and shared.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import threading
import time
import uuid
from pathlib import Path

import httpx

from harness_trainer.rollouts import oracle_edits as edits
from harness_trainer.rollouts.oracle_keystrokes import keystrokes_answer
from harness_trainer.rollouts.tasks import Task
from harness_trainer.rollouts.verifier import SOLUTION_EXIT, SOLUTION_LOG
from harness_trainer.serving.process import free_port

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
# each agent's shell tool and the name of its command argument
SHELL_TOOLS = {"bash": "command", "Bash": "command", "exec_command": "cmd", "run_shell_command": "command",
               "run_commands": "commands"}  # cline's takes a list of commands


def _command(arguments: str) -> str | None:
    args = json.loads(arguments)
    if isinstance(args, dict) and isinstance(args.get("commands"), list) and args["commands"]:
        return args["commands"][0]
    return next((args[key] for key in ("command", "cmd") if key in args), None) if isinstance(args, dict) else None


def shell_arguments(tool: str, command: str) -> str:
    key = SHELL_TOOLS[tool]
    return json.dumps({key: [command] if key == "commands" else command})


def edited_file(command: str) -> str | None:
    """The file a plain one-line `sed -i EXPR FILE` edits (what qwen-code takes over), else None."""
    if "\n" in command or any(c in command for c in ";&|<>`$"):
        return None
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    return words[-1] if len(words) >= 3 and words[0] == "sed" and "-i" in words[1:-1] else None


def _text(content) -> str:
    if isinstance(content, list):  # content parts
        return "\n".join(str(part.get("text", "")) if isinstance(part, dict) else str(part) for part in content)
    return str(content or "")


def shell_output_of(messages: list[dict], command: str) -> str | None:
    """What the agent's shell tool answered to this command (the tool message of its call), or None."""
    ids = {c.get("id") for m in messages if m.get("role") == "assistant" for c in m.get("tool_calls") or []
           if c.get("function", {}).get("arguments") and _command(c["function"]["arguments"]) == command}
    return next((_text(m.get("content")) for m in messages if m.get("role") == "tool" and m.get("tool_call_id") in ids),
                None)


def working_directory(output: str) -> str | None:
    """The directory `pwd` printed, from its tool's answer ("Output: /app" and other lines around it)."""
    for line in output.splitlines():
        word = line.removeprefix("Output:").strip()
        if word.startswith("/") and " " not in word:
            return word
    return None


def plausible_mistake(command: str) -> str:
    """The same command with a slip: its output redirection forgotten (`echo cookie data.txt` prints instead
    of writing the file), or, without one, its first argument capitalised. Well formed, close to right, and
    wrong — what a sloppy solver does. Demonstrations with it leave something for RL to fix: one decision,
    the same in every task, so what RL learns on training tasks carries over to held-out ones."""
    if " > " in command:
        return command.replace(" > ", " ", 1)
    program, _, rest = command.partition(" ")
    return f"{program} {rest[:1].upper()}{rest[1:]}" if rest else command


def solution_steps(task: Task, solve: Path | None = None) -> list[str]:
    """The commands the oracle runs, one per model call. As Harbor's oracle (the default): one call that runs the
    uploaded /solution/solve.sh, unchanged, through its shebang, with [solution] env (its exit status and output
    kept for the record). With the task's metadata `oracle = "inline"`: the script's text itself (less its
    shebang), so traces show the commands a model must learn (SFT demonstrations); `oracle = "per-line"`: one
    command line per call (long multi-turn rollouts). `solve`: a step's own solve.sh (multi-step tasks)."""
    mode = task.metadata.get("oracle")
    if mode not in ("inline", "per-line"):
        env = "".join(f"{key}={shlex.quote(value)} " for key, value in
                      {"DEBIAN_FRONTEND": "noninteractive", **task.solution_env}.items())
        # its output to a file, not a pipe (a server it starts in the background would hold a pipe open), its exit
        # status kept for the record (verifier.solution_report); the agent sees both as before. No " > ": that
        # is where plausible_mistake slips. No command substitution either: gemini-cli refuses any command with one.
        return [f"chmod +x /solution/solve.sh 2>/dev/null; {env}/solution/solve.sh >{SOLUTION_LOG} 2>&1; "
                f"echo $? >{SOLUTION_EXIT}; tail -c 4000 {SOLUTION_LOG}; (read -r code <{SOLUTION_EXIT}; exit $code)"]
    lines = (solve or task.solution).read_text().splitlines()
    if lines and lines[0].startswith("#!"):
        lines = lines[1:]
    if mode == "per-line":
        return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]
    return ["\n".join(lines).strip("\n")]


def _call(tool: str, arguments: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [{
        "id": f"call_{uuid.uuid4().hex[:12]}", "type": "function", "function": {"name": tool, "arguments": arguments}}]}


class OracleUpstream:
    """Runs in a thread of the calling process (uvicorn); `url` is its base URL."""

    def __init__(self, engine_url: str, tasks: list[Task], model: str = "tiny", mistake_rate: float = 0.0,
                 read_before_edit: bool = False, file_edits: bool = False, keystrokes: bool = False):
        self.engine = engine_url.rstrip("/")
        self.read_before_edit, self.file_edits, self.keystrokes = read_before_edit, file_edits, keystrokes
        self.model = model
        self.mistake_rate = mistake_rate
        self._attempts: dict[str, int] = {}  # per task command: attempts answered so far
        self._lock = threading.Lock()
        self.solutions = {t.instruction: solution_steps(t) for t in tasks if t.solution and not t.steps}
        for t in tasks:  # a multi-step task: each step's instruction gets that step's solution (at /solution)
            self.solutions |= {step.instruction: solution_steps(t, solve) for step in t.steps
                               if (solve := step.solution(t.path))}
        if file_edits:  # before any rollout: a solution that is not only file edits cannot be played
            edits.check(self.solutions, {t.instruction: t.name for t in tasks} |
                        {step.instruction: t.name for t in tasks for step in t.steps})
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(timeout=600)  # one scoring call of a 30k-token context takes ~30 s on 2 CPU cores
        self._server = None
        self._scores: dict[tuple[str | None, bytes], list[float]] = {}  # (weight version, tokens) -> logprobs
        self._scoring: dict[tuple[str | None, bytes], threading.Lock] = {}

    # ---- what to say --------------------------------------------------------------------------------------

    def _task(self, messages: list[dict]) -> str | None:
        """The instruction of the task this conversation is about."""
        text = "\n".join(m.get("content") if isinstance(m.get("content"), str) else json.dumps(m.get("content"))
                         for m in messages if m.get("role") in ("user", "system"))
        return next((instruction for instruction in self.solutions if instruction in text), None)

    def _task_steps(self, messages: list[dict]) -> list[str] | None:
        instruction = self._task(messages)
        return self.solutions[instruction] if instruction else None

    def _slips(self, command: str) -> bool:
        """Whether this attempt at the task is made with the slip. Per task, not at random: attempt k slips when
        floor((k+1)·rate) > floor(k·rate), so every task is done wrong at the same rate, evenly spread (at 0.5:
        every second attempt). Drawn at random, with a few attempts per task, some tasks would be always wrong
        and others always right, and SFT learns exactly that: which tasks to get wrong — then RL's groups
        on those tasks all score the same and teach nothing."""
        with self._lock:
            k = self._attempts.get(command, 0)
            self._attempts[command] = k + 1
        return int((k + 1) * self.mistake_rate) > int(k * self.mistake_rate)

    def answer(self, body: dict) -> dict:
        """The assistant message the oracle sends for this request."""
        messages, tools = body.get("messages") or [], body.get("tools") or []
        names = {(t.get("function") or {}).get("name") for t in tools}
        shell = next((name for name in SHELL_TOOLS if name in names), None)
        if self.file_edits and not tools:
            instruction = self._task(messages)
            return {"role": "assistant", "content": edits.edit_answer(messages, instruction,
                                                                      self.solutions[instruction])
                    if instruction else "I do not know this task."}
        if self.keystrokes and not tools:
            steps = self._task_steps(messages)
            return {"role": "assistant", "content": keystrokes_answer(messages, steps, self._slips, plausible_mistake)
                    if steps else "I do not know this task."}
        if shell is None:
            return {"role": "assistant", "content": "Solve the task"}  # a title or summary call
        steps = self._task_steps(messages)
        ran = [_command(c["function"]["arguments"]) for m in messages if m.get("role") == "assistant"
               for c in m.get("tool_calls") or [] if c.get("function", {}).get("arguments")]
        if steps is None:
            return {"role": "assistant", "content": "I do not know this task."}
        todo = [s for s in steps if s not in ran and plausible_mistake(s) not in ran]
        if SUBMIT in ran:  # an agent that goes on after the submit command (opencode) is told it is done
            return {"role": "assistant", "content": "Done."}
        read = todo and self.read_before_edit and "read_file" in names and self._read_first(messages, shell, todo[0])
        if read:
            return read
        if not todo:
            step = SUBMIT
        elif todo[0] == steps[-1]:  # the step that makes the result: where the slip happens
            step = plausible_mistake(todo[0]) if self._slips(todo[0]) else todo[0]
        else:
            step = todo[0]
        return _call(shell, shell_arguments(shell, step))

    def _read_first(self, messages: list[dict], shell: str, step: str) -> dict | None:
        """The call that comes before `step` when it edits a file not read yet: `pwd` (read_file wants an absolute
        path), then read_file; None when the file was read (or the step edits none)."""
        target = edited_file(step)
        if target is None:
            return None
        if not target.startswith("/"):
            done = shell_output_of(messages, "pwd")
            if done is None:
                return _call(shell, shell_arguments(shell, "pwd"))
            cwd = working_directory(done)
            if cwd is None:
                return None  # no directory came back: the edit goes ahead and the agent says why it refuses
            target = f"{cwd.rstrip('/')}/{target}"
        read = [json.loads(c["function"]["arguments"]).get("file_path") for m in messages
                if m.get("role") == "assistant" for c in m.get("tool_calls") or []
                if c.get("function", {}).get("name") == "read_file"]
        return None if target in read else _call("read_file", json.dumps({"file_path": target}))

    # ---- in the engine's own tokens -------------------------------------------------------------------------

    def _render(self, message: dict) -> str:
        """The answer as the model would sample it after the generation prompt (Hermes tool-call format)."""
        parts = [message["content"]] if message.get("content") else []
        for call in message.get("tool_calls") or []:
            args = json.loads(call["function"]["arguments"])
            parts.append("<tool_call>\n" + json.dumps({"name": call["function"]["name"], "arguments": args})
                         + "\n</tool_call>")
        return "\n".join(parts) + "<|im_end|>"

    def completion(self, body: dict) -> dict:
        payload = {"model": self.model, "messages": body["messages"], "add_generation_prompt": True}
        if body.get("tools"):
            payload["tools"] = body["tools"]
        prompt_ids = self.http.post(f"{self.engine}/tokenize", json=payload).json()["tokens"]
        message = self.answer(body)
        ids = self.http.post(f"{self.engine}/tokenize", json={
            "model": self.model, "prompt": self._render(message), "add_special_tokens": False}).json()["tokens"]
        logprobs = self._score(prompt_ids, ids)
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        return {"id": f"chatcmpl-oracle-{uuid.uuid4().hex[:12]}", "object": "chat.completion",
                "created": int(time.time()), "model": self.model, "prompt_token_ids": prompt_ids,
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "token_ids": ids,
                             "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": lp, "top_logprobs": []}
                                                      for t, lp in zip(ids, logprobs)]}}],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                          "total_tokens": len(prompt_ids) + len(ids)}}

    def _weight_version(self) -> str | None:
        try:
            return self.http.get(f"{self.engine}/weight_info", timeout=10).json().get("weight_version")
        except (httpx.HTTPError, ValueError):
            return None

    def _score(self, prompt_ids: list[int], ids: list[int]) -> list[float]:
        """The served model's logprob of each answer token after the prompt: computed once per (weights, tokens);
        concurrent rollouts asking the same wait for the first. A result scored while the weights changed
        (the version differs before and after) is used once and not kept."""
        tokens = prompt_ids + ids
        version = self._weight_version()
        key = (version, hashlib.sha256(json.dumps(tokens).encode()).digest())
        with self._lock:
            lock = self._scoring.setdefault(key, threading.Lock())
        with lock:
            if key in self._scores:
                return self._scores[key]
            scored = self.http.post(f"{self.engine}/v1/completions", json={
                "model": self.model, "prompt": tokens, "max_tokens": 1, "prompt_logprobs": 0}).json()
            logprobs = [min(0.0, entry[str(tok)]["logprob"])
                        for tok, entry in zip(ids, scored["choices"][0]["prompt_logprobs"][len(prompt_ids):])]
            if self._weight_version() == version:
                with self._lock:
                    if len(self._scores) >= 4096:  # bounded: the oldest half goes (answers are short lists)
                        for old in list(self._scores)[:2048]:
                            self._scores.pop(old)
                            self._scoring.pop(old, None)
                    self._scores[key] = logprobs
            else:
                with self._lock:
                    self._scoring.pop(key, None)
        return logprobs

    def stream(self, answer: dict):
        """The same answer as SSE chunks (one for the text, one per tool call, then the finish)."""
        head = {k: answer[k] for k in ("id", "object", "created", "model")}
        head["object"] = "chat.completion.chunk"
        choice, message = answer["choices"][0], answer["choices"][0]["message"]
        yield dict(head, prompt_token_ids=answer["prompt_token_ids"], choices=[
            {"index": 0, "delta": {"role": "assistant", "content": message.get("content") or ""},
             "token_ids": choice["token_ids"], "logprobs": choice["logprobs"], "finish_reason": None}])
        for i, call in enumerate(message.get("tool_calls") or []):
            yield dict(head, choices=[{"index": 0, "delta": {"tool_calls": [dict(call, index=i)]},
                                       "token_ids": [], "logprobs": {"content": []}, "finish_reason": None}])
        yield dict(head, choices=[{"index": 0, "delta": {}, "token_ids": [], "logprobs": {"content": []},
                                   "finish_reason": choice["finish_reason"]}], usage=answer["usage"])

    # ---- server ----------------------------------------------------------------------------------------------

    def app(self):
        from starlette.applications import Starlette
        from starlette.concurrency import run_in_threadpool
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        async def chat(request):
            body = await request.json()
            answer = await run_in_threadpool(self.completion, body)
            if not body.get("stream"):
                return JSONResponse(answer)
            chunks = [f"data: {json.dumps(c)}\n\n" for c in self.stream(answer)] + ["data: [DONE]\n\n"]
            return StreamingResponse(iter(chunks), media_type="text/event-stream")

        async def models(request):
            return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model"}]})

        async def health(request):
            return JSONResponse({"status": "ok"})

        return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                                 Route("/v1/models", models), Route("/health", health)])

    def __enter__(self) -> OracleUpstream:
        import uvicorn

        self._server = uvicorn.Server(uvicorn.Config(self.app(), host="127.0.0.1", port=self.port,
                                                     log_level="error", access_log=False))
        threading.Thread(target=self._server.run, daemon=True).start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the oracle upstream did not start within 30 s")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        if self._server:
            self._server.should_exit = True
        self.http.close()
