#!/usr/bin/env bash
# `make test-all`: every tier in one go, each test once, and how long each tier took at the end.
set -u
PY=.venv/bin/python
names=() times=() codes=()
tier() {
  local name=$1 start=$SECONDS
  shift
  echo "=== test-all: $name: $*"
  "$@"
  codes+=($?) names+=("$name") times+=($((SECONDS - start)))
}
tier default $PY -m pytest
tier slow $PY -m pytest -m slow
tier reliability $PY -m pytest tests/reliability -m reliability
tier reliability-bench $PY bench/reliability.py --fuzz 10000 --load-minutes 10 --sessions 256
status=0
echo "=== test-all: time per tier"
for i in "${!names[@]}"; do
  verdict=passed; [ "${codes[$i]}" = 0 ] || { verdict="FAILED (exit ${codes[$i]})"; status=1; }
  printf '%-18s %4d min %02d s  %s\n' "${names[$i]}" $((times[i] / 60)) $((times[i] % 60)) "$verdict"
done
exit $status
