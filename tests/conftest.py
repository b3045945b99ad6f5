"""One tiny model and one real vLLM server for the whole test session.

The server boots in the background while the tests that need no engine run first. Set HARNESS_TEST_VLLM_URL to
attach to a server you already run instead (it must serve the tiny model as 'tiny', with LoRA on:
EngineConfig(lora_rank=8, max_loras=4)).
"""

from __future__ import annotations

import os

import pytest

from harness_trainer.models.tiny import ensure_tiny_model
from harness_trainer.serving.engine import EngineConfig, VLLMServer


@pytest.fixture(scope="session")
def tiny_model_dir():
    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _needs_engine(item) -> bool:
    """Asks for the session's engine: as a fixture, or by name at run time (marked `engine`)."""
    return "engine" in getattr(item, "fixturenames", ()) or item.get_closest_marker("engine") is not None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """The tests that need no engine run first, while the session's vLLM boots beside them (`_engine_boot`): a
    cold start takes about a minute on 2 cores and keeps less than one of them busy."""
    items.sort(key=_needs_engine)  # stable: each group keeps pytest's order


@pytest.fixture(scope="session", autouse=True)
def _engine_boot(request, tmp_path_factory):
    """The session's one vLLM server, started in the background at the first test when any collected test needs it
    and HARNESS_TEST_VLLM_URL names none; stopped at the session's end."""
    if os.environ.get("HARNESS_TEST_VLLM_URL") or not any(map(_needs_engine, request.session.items)):
        yield None
        return
    from concurrent.futures import ThreadPoolExecutor

    # LoRA on (adapters up to rank 8, tests/serving/test_lora.py): base-model calls and full-weight reloads are
    # unchanged
    server = VLLMServer(EngineConfig(model=str(ensure_tiny_model()), served_model_name="tiny", max_model_len=32768,
                                     log_path=tmp_path_factory.mktemp("vllm") / "vllm.log", lora_rank=8,
                                     max_loras=4))
    with ThreadPoolExecutor(1, thread_name_prefix="vllm-boot") as pool:
        yield pool.submit(server.start)
        server.stop()  # a boot still running (a session stopped early) fails at once
    server.stop()  # and one the stop came too early for, once the pool has waited for it


@pytest.fixture(scope="session")
def engine(_engine_boot):
    if url := os.environ.get("HARNESS_TEST_VLLM_URL"):
        return VLLMServer.attach(url)
    if _engine_boot is None:
        pytest.fail("this test asks for the engine at run time: mark it @pytest.mark.engine so it boots one")
    return _engine_boot.result()


@pytest.fixture(scope="session")
def proxy(engine, tmp_path_factory):
    """One capture proxy (in its own environment) in front of the session's engine."""
    from harness_trainer.proxy.client import ProxyServer

    root = tmp_path_factory.mktemp("proxy")
    with ProxyServer(engine.url, journal=root / "journal", log_path=root / "proxy.log") as server:
        yield server


@pytest.fixture
def fresh_engine(engine, proxy, tiny_model_dir):
    """The session's engine, given back with the tiny model's own weights and no LoRA adapter after the test, and
    the proxy back on the served model (for tests that sync weights into it)."""
    import httpx

    from harness_trainer.serving.weight_sync import reload_weights

    yield engine
    reload_weights(engine, tiny_model_dir, version=0)
    for model in httpx.get(engine.url + "/v1/models", timeout=10).json()["data"]:
        if model.get("parent"):
            httpx.post(engine.url + "/v1/unload_lora_adapter", json={"lora_name": model["id"]}, timeout=30)
    proxy.client.set_policy_version(0)


SMOKE_FLAGS = ["--harness", "mini-swe-agent", "--dataset", "builtin:toy-train", "--max-steps", "2",
               "--num-generations", "2", "--max-concurrent-rollouts", "2", "--agent-step-limit", "2",
               "--max-completion-tokens", "48", "--learning-rate", "1e-3", "--report-to", "trackio"]


def run_smoke(root, *flags: str):
    """`harness-train` (the console script's module, in a subprocess) on the 2-step smoke configuration."""
    import subprocess
    import sys

    out = root / "run"
    result = subprocess.run([sys.executable, "-m", "harness_trainer.commands.cli", *SMOKE_FLAGS, *flags,
                             "--output-dir", str(out)], capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, TRACKIO_DIR=str(root / "trackio")))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def smoke_run(engine, tiny_model_dir, tmp_path_factory):
    """The 2-step smoke run of `harness-train` (mini-swe-agent, the embedded default), once per session, on the
    session's engine (it syncs its weights there: given back after); its test checks what it leaves behind, the
    viewer's tests browse its folder. The same run with an engine of its own is in the slow tier."""
    from harness_trainer.serving.weight_sync import reload_weights

    try:
        return run_smoke(tmp_path_factory.mktemp("smoke"), "--vllm-url", engine.url)
    finally:
        reload_weights(engine, tiny_model_dir, version=0)


def pytest_terminal_summary(terminalreporter):
    """Where the time went, per test file (setup, call and teardown together), after pytest's slowest-tests list."""
    totals: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(getattr(report, "duration", None), float) and getattr(report, "nodeid", ""):
                path = report.nodeid.split("::")[0]
                totals[path] = totals.get(path, 0.0) + report.duration
    if not totals:
        return
    terminalreporter.write_sep("=", "time per test file")
    for path, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}")
    terminalreporter.write_line(f"{sum(totals.values()):8.1f} s  in all")
