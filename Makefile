# The README's two commands: `make demo` and `make test`. Each runs the idempotent set-up first.
PY := .venv/bin/python

.PHONY: setup test test-stress test-slow test-reliability test-all demo engine-demo bench docs clean

setup:
	@HARBOR=$(HARBOR) BENCH=$(BENCH) bash scripts/setup.sh

test: setup
	$(PY) -m pytest

# The default tier beside a CPU hog on every core (HOG_LOAD percent busy, 60 unless set): no test may race the clock.
test-stress: setup
	@bash scripts/test_stress.sh $(ARGS)

test-slow: setup
	$(PY) -m pytest -m slow

# The whole reliability suite (~35 min): the CLI fault run, 10,000 fuzzed requests, 10 minutes of load on each proxy.
test-reliability: setup
	$(PY) -m pytest tests/reliability -m 'reliability or not slow'
	$(PY) bench/reliability.py --fuzz 10000 --load-minutes 10 --sessions 256

# Every tier, each test once (default, slow, reliability, the reliability bench), with each tier's time at the end.
test-all: setup
	@bash scripts/test_all.sh

# The learning proof on the embedded default: base -> SFT -> SFT+GRPO, real agents and sandboxes (~9 min; opencode ~30)
# (mini-swe-agent; `make demo HARNESS=opencode` through opencode, into runs/demo-opencode).
HARNESS ?= mini-swe-agent
DEMO_DIR := runs/demo$(if $(filter mini-swe-agent,$(HARNESS)),,-$(HARNESS))
demo: setup
	rm -rf $(DEMO_DIR)
	$(PY) -m harness_trainer.commands.proof --harness $(HARNESS) --output-dir $(DEMO_DIR)

# The engine half on its own: captured ids/logprobs, a weight reload, vLLM vs transformers (~1 min).
engine-demo: setup
	$(PY) -m harness_trainer.commands.engine_demo

# docs/cli.md from the configs' fields (tests/test_layout.py fails when it is stale).
docs: setup
	$(PY) -m harness_trainer.commands.reference > docs/cli.md

bench: BENCH = 1
bench: setup
	$(PY) bench/engine.py
	$(PY) bench/proxy.py
	$(PY) bench/long_rollouts.py
	$(PY) bench/many_sessions.py
	$(PY) bench/rollouts.py
	$(PY) bench/sandboxes.py
	$(PY) bench/trainer.py
	$(PY) bench/pipeline.py

clean:
	rm -rf .venv .venv-engine .venv-proxy .venv-mini .venv-harbor .tools .setup-stamps
