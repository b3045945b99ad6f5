"""A finished rollout's trace as the pool collects it: read on the reader thread, checked by OpenEnv's validator in
the checker process; a trace that breaks the contract is an error, never a trace; a checker that dies is replaced
and its check done anyway."""

from __future__ import annotations

import json
import os

import psutil
import pytest
from openenv.core.harness.training import TrainingTrace

from harness_trainer._exceptions import CaptureContractError
from harness_trainer.rollouts.trace_reader import CHECKER, collect_trace


def trace(*turns) -> bytes:
    return json.dumps({"schema_version": 1, "turns": list(turns)}).encode()


def turn(k: int, **changed) -> dict:
    prompt = [1, 2, 3] + [7] * k
    return {"node_id": f"s:{k}", "prompt_token_ids": prompt, "completion_token_ids": [4, 5],
            "per_token_logps": [-0.1, -0.2], "loss_mask": [0] * len(prompt) + [1, 1],
            "request": {"messages": [{"role": "user", "content": "hi"}]}, "response": {}, "metadata": {"k": k},
            **changed}


def test_a_trace_that_validates_is_kept_as_its_wire_form():
    body = trace(turn(0), turn(1))
    assert collect_trace(lambda: body, "a trace") == TrainingTrace.model_validate_json(body).model_dump(mode="json")


@pytest.mark.parametrize("body, says", [
    (trace(turn(0, per_token_logps=[-0.1])), "logprob_misalign"),  # OpenEnv's own finding, word for word
    (trace(turn(0, loss_mask=[1])), "length_mismatch"),
    (b'{"schema_version": 1, "turns": [', "the TrainingTrace contract"),  # not JSON: still the contract's error
])
def test_a_trace_that_breaks_the_contract_is_an_error(body, says):
    with pytest.raises(CaptureContractError, match=says) as caught:
        collect_trace(lambda: body, "rollout r1 (toy)")
    assert str(caught.value).startswith("rollout r1 (toy): the captured trace breaks the TrainingTrace contract")


def test_the_check_runs_in_a_process_of_its_own_that_openenv_s_package_does_not_weigh_down():
    collect_trace(lambda: trace(turn(0)), "a trace")
    checker = psutil.Process(CHECKER.pid)
    assert checker.ppid() == os.getpid() and "trace_check" in " ".join(checker.cmdline())
    assert checker.memory_info().rss < 150e6  # pydantic and OpenEnv's model only: not gradio (~220 MB)


def test_a_checker_that_died_is_replaced_and_no_trace_goes_unchecked():
    good, bad = trace(turn(0)), trace(turn(0, per_token_logps=[]))
    collect_trace(lambda: good, "a trace")
    first = psutil.Process(CHECKER.pid)
    first.kill()
    first.wait(30)
    # the check the dead process was handed is done on this thread; the next one starts a new process
    with pytest.raises(CaptureContractError, match="logprob_misalign"):
        collect_trace(lambda: bad, "a trace")
    assert collect_trace(lambda: good, "a trace")["turns"][0]["node_id"] == "s:0"
    assert CHECKER.pid not in (None, first.pid) and psutil.Process(CHECKER.pid).is_running()
