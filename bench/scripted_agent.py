"""A scripted agent for benches at scale: the standard library only, so it runs in any jail with the host's Python.

    python3 scripted_agent.py CALLS FINAL_KB ANSWER_FILE INSTRUCTION

CALLS model calls (odd ones streamed) through $OPENAI_BASE_URL with key $OPENAI_API_KEY, the conversation growing
by a tool result each turn to about FINAL_KB, a shell command run between calls; then the fourth word of
INSTRUCTION ("Write the word W ...") written into ANSWER_FILE, which the task's verifier checks. Each user message
starts with [[KEY:k]] and the stub engine answers "ok KEY:k": an answer meant for another session or another turn
is seen here (exit 3). Each call's latency (s) goes to /logs/agent/latencies.json (the trial's own folder on the
host, in a jail or a container), for the bench to read.
"""

import json
import os
import subprocess
import sys
import time
import urllib.request


def call(base: str, key: str, messages: list, stream: bool) -> tuple[str, float]:
    body = json.dumps({"model": os.environ.get("OPENAI_MODEL", "tiny"), "messages": messages, "max_tokens": 32,
                       "stream": stream}).encode()
    request = urllib.request.Request(f"{base}/chat/completions", data=body, headers={
        "content-type": "application/json", "authorization": f"Bearer {key}"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as answer:
        raw = answer.read()
    elapsed = time.perf_counter() - started
    if not stream:
        return json.loads(raw)["choices"][0]["message"]["content"], elapsed
    text = []
    for line in raw.decode().splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices") or []:
                text.append((choice.get("delta") or {}).get("content") or "")
    return "".join(text), elapsed


def main() -> int:
    calls, final_kb, answer_file, word = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4].split()[3]
    base, key = os.environ["OPENAI_BASE_URL"].rstrip("/"), os.environ["OPENAI_API_KEY"]
    grow = final_kb * 1024 // calls
    messages = [{"role": "system", "content": "You are a coding agent."}]
    latencies = []
    for k in range(calls):
        output = subprocess.run(["sh", "-c", f"echo turn {k} >> /app/agent.log; wc -l < /app/agent.log"],
                                capture_output=True, text=True).stdout.strip()
        messages.append({"role": "user", "content": f"[[{key}:{k}]] lines {output} " + "log " * (grow // 4)})
        try:
            text, elapsed = call(base, key, messages, stream=k % 2 == 1)
        except Exception as exc:  # kept in the trial's logs, which the bench keeps for a failed rollout
            os.makedirs("/logs/agent", exist_ok=True)
            with open("/logs/agent/error.txt", "w") as f:
                f.write(f"call {k}: {type(exc).__name__}: {exc}\n")
            raise
        latencies.append(round(elapsed, 4))
        if text != f"ok {key}:{k}":
            print(json.dumps({"error": f"call {k} got {text[:80]!r}"}))
            return 3
        messages.append({"role": "assistant", "content": text})
    with open(answer_file, "w") as f:
        f.write(word + "\n")
    os.makedirs("/logs/agent", exist_ok=True)
    with open("/logs/agent/latencies.json", "w") as f:
        json.dump(latencies, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
