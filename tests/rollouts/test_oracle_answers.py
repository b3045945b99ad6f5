"""The oracle's choice of call, given the conversation so far (no engine: `answer` is pure)."""

import json

import pytest

from harness_trainer._exceptions import TaskError
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


def test_an_agent_without_tools_gets_the_solution_as_file_edits_in_its_format():
    """aider's whole-file and SEARCH/REPLACE formats: the file asked for by name until the agent shows it, the
    edits, then "Done."; its own example answers (before the instruction) are not the oracle's."""
    tasks = load_dataset("builtin:bugfix")
    task = next(t for t in tasks if t.name == "bugfix-last-item")  # sed with escaped brackets: literal text
    oracle = OracleUpstream("http://127.0.0.1:9", tasks, file_edits=True)
    example = {"role": "assistant", "content": "hello.py\n```\nprint('hi')\n```\n"}
    for rules, edit in (("a *file listing* format", "items.py\n```\ndef last(items):\n    return items[-1]\n```\n"),
                        ("*SEARCH/REPLACE block* Rules", "items.py\n```\n<<<<<<< SEARCH\n    return items[len(items)]\n"
                                                         "=======\n    return items[-1]\n>>>>>>> REPLACE\n```\n")):
        messages = [{"role": "system", "content": rules}, example, {"role": "user", "content": task.instruction}]
        assert oracle.answer({"messages": messages})["content"] == "I need to edit items.py."
        messages += [{"role": "assistant", "content": "I need to edit items.py."}, {"role": "user", "content": (
            "I added these files to the chat: items.py\n\nitems.py\n```\ndef last(items):\n"
            "    return items[len(items)]\n```\n")}]
        assert oracle.answer({"messages": messages})["content"] == edit
        assert oracle.answer({"messages": [*messages, {"role": "assistant", "content": edit}]})["content"] == "Done."
    toy = load_dataset("builtin:toy-train")[0]
    answer = OracleUpstream("http://127.0.0.1:9", [toy], file_edits=True).answer(
        {"messages": [{"role": "user", "content": toy.instruction}]})["content"]
    word, file = toy.metadata["word"], toy.metadata["file"]
    assert answer == f"{file}\n```\n{word}\n```\n"  # a new file: its whole text


def test_a_solution_that_is_not_only_file_edits_is_refused_for_an_agent_without_tools():
    with pytest.raises(TaskError, match="not so: logs-errors. Run those tasks through an agent with a shell tool"):
        OracleUpstream("http://127.0.0.1:9", load_dataset("builtin:logs"), file_edits=True)


def test_a_terminal_agent_gets_keystrokes_waits_for_the_prompt_then_confirms_completion():
    """terminus-2 (no tools; the model answers in its JSON of keystrokes): history expansion off, then the solution
    typed; while the pane shows no prompt after it the oracle waits; then task_complete, and again when asked."""
    (toy,) = load_dataset("builtin:toy-heldout")[:1]
    oracle = OracleUpstream("http://127.0.0.1:9", [toy], keystrokes=True)
    (solution,) = oracle.solutions[toy.instruction]
    messages = [{"role": "user", "content": f"Task Description:\n{toy.instruction}\n\nCurrent terminal state:\n$ "}]

    def next_answer(shown: str) -> dict:
        answer = json.loads(oracle.answer({"messages": messages})["content"])
        messages.extend([{"role": "assistant", "content": json.dumps(answer)}, {"role": "user", "content": shown}])
        return answer

    assert next_answer("New Terminal Output:\nroot@host:/app# set +H\nroot@host:/app#\n\n")["commands"] == [
        {"keystrokes": "set +H\n", "duration": 1.0}]
    typed = next_answer("New Terminal Output:\nroot@host:/app# " + solution + "\n")  # still running: no prompt
    assert typed["commands"][0]["keystrokes"] == solution + "\n" and not typed["task_complete"]
    wait = next_answer("New Terminal Output:\nroot@host:/app#\n\n")
    assert wait["commands"] == [{"keystrokes": "", "duration": 5.0}] and not wait["task_complete"]
    done = next_answer("Current terminal state:\nroot@host:/app#\n\nAre you sure you want to mark the task as "
                       "complete? ...")
    assert done["task_complete"] and done["commands"] == []
    assert next_answer("root@host:/app#")["task_complete"]  # confirmed
