"""Harbor-shaped tasks written here, one feature of the format each, for the container tests. Every one is
won by its own solution/solve.sh (the oracle), and only where the environment was really built as its task
says: each verifier checks what its Dockerfile, image, workdir, env tables or network setting made.

    build        environment/Dockerfile with RUN, ENV, WORKDIR, COPY (FROM the local python:3.11-slim), reference
                 data the image keeps in /tests (its tests read it) and a file in its /home;
                 solve.sh with comments and a heredoc that holds '#' lines and a blank line; test.sh with a
                 python shebang; reward.json with two keys ("reward", "efficiency")
    image        [environment] docker_image of an image with neither Python nor Node, workdir, env with a
                 ${VAR:-default} template, allow_internet = false (the verifier checks there is no network
                 interface but lo); [verifier] env; [solution] env; reward.json with one key ("correctness");
                 cpus = 64, more than a test machine has (clamped to the host's, one warning); an
                 environment/Dockerfile too, which loses to the docker_image as in Harbor (--force-build builds it)
    plain        no image: environment/app/ copied into /app (runs under local and docker alike)
    multi-step   [[steps]]: three steps in one container, a min_reward gate, a step's workdir/setup.sh, shared
                 and per-step tests and solutions, a step's own verifier env
"""

from __future__ import annotations

from pathlib import Path

BARE_IMAGE = "harness-test/bare:12"  # scripts/base_images.sh: bookworm without Python


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def build_task(root: Path) -> Path:
    task = root / "build"
    _write(task / "instruction.md", "Write the greeting and the number from data.txt into answer.txt.\n")
    _write(task / "task.toml", '''schema_version = "1.1"

[task]
name = "harness-test/build"
description = "an image built from its Dockerfile"

[agent]
timeout_sec = 600
user = "agent"

[verifier]
timeout_sec = 60
user = "root"

[environment]
build_timeout_sec = 300
cpus = 1
memory_mb = 512
''')
    _write(task / "environment" / "Dockerfile", '''FROM python:3.11-slim
RUN useradd --create-home agent && mkdir -p /srv/app && echo "built" > /srv/app/marker.txt && chown -R agent /srv/app
RUN mkdir -p /tests && echo 42 > /tests/expected.txt && echo "agent notes" > /home/agent/notes.txt
ENV GREETING=hello
WORKDIR /srv/app
COPY --chown=agent data.txt /srv/app/data.txt
USER agent
''')
    _write(task / "environment" / "data.txt", "42\n")
    _write(task / "solution" / "solve.sh", '''#!/bin/bash
# The answer: the image's ENV and the file its Dockerfile copied.

# (a blank line above, a comment here: both must reach bash as written)
number=$(cat data.txt)
cat > answer.txt <<EOF
# kept: a heredoc line that starts with #

$GREETING $number
EOF
''', 0o755)
    _write(task / "tests" / "test.sh", '''#!/usr/bin/env python3
import json
import pathlib

answer = pathlib.Path("/srv/app/answer.txt")
built = pathlib.Path("/srv/app/marker.txt").read_text() == "built\\n"
expected = pathlib.Path("/tests/expected.txt").read_text().strip()  # the image's reference data, under tests/
right = answer.is_file() and answer.read_text() == f"# kept: a heredoc line that starts with #\\n\\nhello {expected}\\n"
import pwd, os
owner = pwd.getpwuid(answer.stat().st_uid).pw_name if answer.is_file() else None
print("home kept:", pathlib.Path("/home/agent/notes.txt").is_file(), "built:", built,
      "answer:", answer.read_text() if answer.is_file() else None, "written by:", owner,
      "verified by:", pwd.getpwuid(os.getuid()).pw_name)
pathlib.Path("/logs/verifier/reward.json").write_text(
    json.dumps({"reward": float(built and right), "efficiency": 0.5}))
''', 0o755)
    return task


def image_task(root: Path) -> Path:
    task = root / "image"
    _write(task / "instruction.md", "Write the word from $WORD_SOURCE into word.txt.\n")
    _write(task / "task.toml", f'''[agent]
timeout_sec = 600

[verifier]
timeout_sec = 60
env = {{ EXPECTED = "${{HARNESS_CORPUS_WORD:-seven}}" }}

[solution]
env = {{ SOLUTION_WORD = "seven" }}

[environment]
docker_image = "{BARE_IMAGE}"
workdir = "/work"
allow_internet = false
cpus = 64
env = {{ WORD_SOURCE = "the solution's env" }}
''')
    # a Dockerfile beside the docker_image, as tasks that ship both: Harbor runs the image (this one has python, so
    # the verifier's "no python" fails if it is built instead)
    _write(task / "environment" / "Dockerfile", "FROM python:3.11-slim\nWORKDIR /work\n")
    _write(task / "solution" / "solve.sh", '#!/bin/bash\necho "$SOLUTION_WORD" > word.txt\n', 0o755)
    _write(task / "tests" / "test.sh", '''#!/bin/bash
# One network interface (lo): allow_internet = false. No python in the image. The word from the solution's env.
interfaces=$(ls /sys/class/net | tr '\\n' ' ')
python=$(command -v python3 || true)
echo "interfaces: $interfaces python: ${python:-none} word: $(cat /work/word.txt 2>/dev/null)"
if [ "$interfaces" = "lo " ] && [ -z "$python" ] && [ "$(cat /work/word.txt 2>/dev/null)" = "$EXPECTED" ]; then
  echo '{"correctness": 1}' > /logs/verifier/reward.json
else
  echo '{"correctness": 0}' > /logs/verifier/reward.json
fi
''', 0o755)
    return task


def plain_task(root: Path) -> Path:
    task = root / "plain"
    _write(task / "instruction.md", "Copy the first line of notes.txt into first.txt.\n")
    _write(task / "task.toml", "[agent]\ntimeout_sec = 600\n\n[verifier]\ntimeout_sec = 60\n")
    _write(task / "environment" / "app" / "notes.txt", "alpha\nbeta\n")
    _write(task / "solution" / "solve.sh", "#!/bin/bash\n# first line only\nhead -n 1 notes.txt > first.txt\n", 0o755)
    _write(task / "tests" / "test.sh", '''#!/bin/bash
if [ "$(cat /app/first.txt 2>/dev/null)" = "alpha" ]; then echo 1 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt; fi
''', 0o755)
    return task


def multi_step_task(root: Path) -> Path:
    """Three steps in one container (Harbor 0.26's format): each builds on the last; a min_reward gate on the
    first; the second's workdir/setup.sh leaves it a file; a shared tests/ helper, two steps with their own
    test.sh and one using the shared one; per-step solutions and a step's own verifier env."""
    task = root / "multi-step"
    _write(task / "task.toml", '''multi_step_reward_strategy = "mean"

[agent]
timeout_sec = 600

[environment]
docker_image = "python:3.11-slim"
workdir = "/app"

[[steps]]
name = "create"
min_reward = 1.0

[[steps]]
name = "extend"
[steps.verifier]
env = { EXPECTED_LINES = "2" }

[[steps]]
name = "count"
''')
    _write(task / "tests" / "check.sh", '''# shared by every step's verifier: the reward, 1 when the check holds
reward() { if "$@"; then echo 1; else echo 0; fi > /logs/verifier/reward.txt; }
''')
    _write(task / "tests" / "test.sh", '''#!/bin/bash
. /tests/check.sh
reward [ "$(cat /app/count.txt 2>/dev/null)" = "2" ]
''', 0o755)
    steps = {"create": ("Create /app/notes.txt holding the line alpha.", "echo alpha > /app/notes.txt",
                        'reward [ "$(head -n 1 /app/notes.txt 2>/dev/null)" = "alpha" ]'),
             "extend": ("Append the line in /app/next.txt to /app/notes.txt.", "cat /app/next.txt >> /app/notes.txt",
                        'reward [ "$(wc -l < /app/notes.txt)" = "$EXPECTED_LINES" ]'),
             "count": ("Write the number of lines of /app/notes.txt into /app/count.txt.",
                       "wc -l < /app/notes.txt > /app/count.txt", None)}
    for name, (instruction, solution, check) in steps.items():
        _write(task / "steps" / name / "instruction.md", instruction + "\n")
        _write(task / "steps" / name / "solution" / "solve.sh", f"#!/bin/bash\n{solution}\n", 0o755)
        if check:
            _write(task / "steps" / name / "tests" / "test.sh", f"#!/bin/bash\n. /tests/check.sh\n{check}\n", 0o755)
    _write(task / "steps" / "extend" / "workdir" / "setup.sh", "echo beta > /app/next.txt\n")
    return task


def service_task(root: Path) -> Path:
    """Servers the tests query, as Harbor leaves them running: one the image's ENTRYPOINT starts, one the
    solution starts in the background (the agent's command has ended when the verifier runs)."""
    task = root / "service"
    _write(task / "instruction.md", "Serve /srv/www over HTTP on port 8123 with a file `answer` holding the word "
                                    "served, and leave the server running.\n")
    _write(task / "task.toml", "[agent]\ntimeout_sec = 600\n\n[verifier]\ntimeout_sec = 60\n\n"
                               "[environment]\nallow_internet = false\n")
    _write(task / "environment" / "Dockerfile", "FROM python:3.11-slim\nCOPY entry.sh /entry.sh\n"
                                                'RUN chmod 755 /entry.sh\nWORKDIR /app\nENTRYPOINT ["/entry.sh"]\n')
    _write(task / "environment" / "entry.sh", """#!/bin/sh
mkdir -p /srv/status && echo ready > /srv/status/state
nohup python3 -m http.server 8124 --directory /srv/status >/dev/null 2>&1 &
exec "$@"
""")
    _write(task / "solution" / "solve.sh", """#!/bin/bash
mkdir -p /srv/www && echo served > /srv/www/answer
nohup python3 -m http.server 8123 --directory /srv/www >/dev/null 2>&1 &
""", 0o755)
    _write(task / "tests" / "test.sh", '''#!/usr/bin/env python3
import pathlib
import time
import urllib.request


def fetch(url):  # a server started a moment ago may not listen yet (a minute: far above its start, under load too)
    for _ in range(600):
        try:
            return urllib.request.urlopen(url, timeout=5).read().decode().strip()
        except OSError:
            time.sleep(0.1)
    return None


state, answer = fetch("http://127.0.0.1:8124/state"), fetch("http://127.0.0.1:8123/answer")
print("entrypoint's server:", state, "agent's server:", answer)
pathlib.Path("/logs/verifier/reward.txt").write_text(str(int(state == "ready" and answer == "served")))
''', 0o755)
    return task


def compose_task(root: Path) -> Path:
    """Harbor's multi-container environment: environment/docker-compose.yaml adds a service the tests and the
    agent reach by its name (built from its own Dockerfile, healthy before the trial starts) and gives `main` an
    environment variable; no internet, yet the services reach each other."""
    task = root / "compose"
    _write(task / "instruction.md", "Write what $SIDECAR_URL/hello answers into /app/answer.txt.\n")
    _write(task / "task.toml", '[agent]\ntimeout_sec = 600\n\n[verifier]\ntimeout_sec = 60\n\n[environment]\n'
                               'docker_image = "python:3.11-slim"\nworkdir = "/app"\nallow_internet = false\n')
    _write(task / "environment" / "docker-compose.yaml", """services:
  main:
    depends_on:
      web:
        condition: service_healthy
    environment:
      SIDECAR_URL: http://web:8000
  web:
    build: ./web
    healthcheck:
      test: ["CMD", "python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/hello')"]
      interval: 1s
      retries: 120
""")
    _write(task / "environment" / "web" / "Dockerfile", "FROM python:3.11-slim\nRUN mkdir /w && echo sidecar > "
                                                        '/w/hello\nCMD ["python3", "-m", "http.server", "8000", '
                                                        '"--directory", "/w"]\n')
    _write(task / "solution" / "solve.sh", """#!/bin/bash
python3 - > /app/answer.txt <<'EOF'
import os, urllib.request
print(urllib.request.urlopen(os.environ["SIDECAR_URL"] + "/hello").read().decode().strip())
EOF
""", 0o755)
    _write(task / "tests" / "test.sh", '''#!/usr/bin/env python3
import pathlib
import urllib.request

answer = pathlib.Path("/app/answer.txt")
served = urllib.request.urlopen("http://web:8000/hello", timeout=10).read().decode().strip()
print("the service says:", served, "answer:", answer.read_text().strip() if answer.is_file() else None)
right = answer.is_file() and answer.read_text().strip() == served == "sidecar"
pathlib.Path("/logs/verifier/reward.txt").write_text(str(int(right)))
''', 0o755)
    return task


def corpus(root: Path) -> Path:
    """The winning corpus (build, image, plain, multi-step) in one dataset folder."""
    for make in (build_task, image_task, plain_task, multi_step_task):
        make(root)
    return root
