"""The oracle's choice of call, given the conversation so far (no engine: `answer` is pure)."""

import json

from harness_trainer.rollouts.oracle import SUBMIT, OracleUpstream
from harness_trainer.rollouts.tasks import load_dataset

TOOLS = [{"type": "function", "function": {"name": name}} for name in ("run_shell_command", "read_file")]


def _play(oracle: OracleUpstream, instruction: str, cwd_output: str) -> list[tuple[str, dict]]:
    """Answer, feed each call's result back as the agent would (pwd prints `cwd_output`), until the oracle stops."""
    messages, calls = [{"role": "user", "content": instruction}], []
    for _ in range(8):
        message = oracle.answer({"messages": messages, "tools": TOOLS})
        messages.append(message)
        if not message.get("tool_calls"):
            return calls
        call = message["tool_calls"][0]
        name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
        calls.append((name, args))
        output = cwd_output if args.get("command") == "pwd" else "ok"
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})
    raise AssertionError(f"the oracle did not stop: {calls}")


def test_an_agent_that_refuses_unread_edits_gets_pwd_then_its_read_then_the_edit():
    tasks = load_dataset("builtin:bugfix")
    task = tasks[0]
    (edit,) = OracleUpstream("http://127.0.0.1:9", tasks, read_before_edit=True).solutions[task.instruction]
    careful = _play(OracleUpstream("http://127.0.0.1:9", tasks, read_before_edit=True), task.instruction,
                    "Command: pwd\nDirectory: (root)\nOutput: /app\nExit Code: 0")
    target = edit.split()[-1]
    assert careful == [("run_shell_command", {"command": "pwd"}), ("read_file", {"file_path": f"/app/{target}"}),
                       ("run_shell_command", {"command": edit}), ("run_shell_command", {"command": SUBMIT})]
    # without the flag (every other agent), or with a command that edits no file: the edit, then the submit
    plain = _play(OracleUpstream("http://127.0.0.1:9", tasks), task.instruction, "/app")
    assert plain == [("run_shell_command", {"command": edit}), ("run_shell_command", {"command": SUBMIT})]
    toy = load_dataset("builtin:toy-train")[0]
    (write,) = OracleUpstream("http://127.0.0.1:9", [toy]).solutions[toy.instruction]
    assert _play(OracleUpstream("http://127.0.0.1:9", [toy], read_before_edit=True), toy.instruction, "/app") == [
        ("run_shell_command", {"command": write}), ("run_shell_command", {"command": SUBMIT})]
