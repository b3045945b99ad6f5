# The README's two commands: `make demo` and `make test`. Each runs the idempotent set-up first.
PY := .venv/bin/python

.PHONY: setup test test-slow demo bench clean

setup:
	@HARBOR=$(HARBOR) bash scripts/setup.sh

test: setup
	$(PY) -m pytest

test-slow: setup
	$(PY) -m pytest -m slow

demo: setup
	$(PY) -m harness_trainer.demo

bench: setup
	$(PY) bench/engine.py
	$(PY) bench/proxy.py
	$(PY) bench/rollouts.py
	$(PY) bench/trainer.py

clean:
	rm -rf .venv .venv-engine .venv-proxy .venv-mini .venv-harbor .tools .setup-stamps
