#!/usr/bin/env bash
# `make test-stress`: the default tier while a CPU hog keeps every core busy (HOG_LOAD percent of the time each,
# 60 unless set; scripts/cpu_hog.py). A test that passes alone and fails here races the clock (docs/tests.md).
# Extra arguments go to pytest (`make test-stress ARGS='tests/proxy/test_capture.py'`).
set -u
cd "$(dirname "$0")/.."
PY=.venv/bin/python
load=${HOG_LOAD:-60}
$PY scripts/cpu_hog.py --workers "$(nproc)" --load "$load" --parent $$ &
hog=$!
trap 'kill "$hog" 2>/dev/null; wait "$hog" 2>/dev/null' EXIT
echo "test-stress: a CPU hog (pid $hog) keeps $(nproc) cores $load % busy beside the tests"
$PY -m pytest "$@"
