"""Fault injection for the reliability tests: an agent that can be told to hang, crash or call twice. The TCP hop
that cuts or stalls an engine is tests/stubs.py's Link."""

from __future__ import annotations

import shlex

from harness_trainer.agents.command import CommandHarness

# The agent: one model call (retried, as real agents retry their API), its answer written to /app/answer.txt;
# then what its instruction says: hang, crash (SIGKILL itself), or pause and call once more.
AGENT = r"""
import json, os, sys, time, urllib.request
mode = sys.argv[1]
def call(stream, history=()):
    body = {"model": os.environ["OPENAI_MODEL"], "max_tokens": 48 if stream else 4, "stream": stream,
            "messages": [{"role": "user", "content": mode}, *history]}
    headers = {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"}
    for attempt in range(90):
        try:
            request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
                                             json.dumps(body).encode(), headers)
            with urllib.request.urlopen(request, timeout=60) as answer:
                if not stream:
                    return json.load(answer)["choices"][0]["message"]["content"] or ""
                text = ""
                for line in answer:
                    if line.startswith(b"data: {"):
                        chunk = json.loads(line[6:])
                        if chunk.get("error"):
                            raise RuntimeError(chunk["error"])
                        for choice in chunk.get("choices") or []:
                            text += choice["delta"].get("content") or ""
                return text
        except Exception as exc:
            print(f"model call failed ({exc}); retrying", file=sys.stderr, flush=True)
            time.sleep(1)
    sys.exit(3)
first = call("stream" in mode)
open("/app/answer.txt", "w").write(first)
if "hang" in mode:
    time.sleep(600)
if "crash" in mode:
    os.kill(os.getpid(), 9)
if "twice" in mode:
    time.sleep(4)
    again = [{"role": "assistant", "content": first}, {"role": "user", "content": "Once more."}]
    open("/app/answer.txt", "w").write(call(False, again))
"""
AGENT_HARNESS = CommandHarness(f"python3 -c {shlex.quote(AGENT)} {{instruction}}")
