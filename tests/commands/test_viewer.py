"""The run viewer in a real headless browser (Debian's chromium and its driver, installed by `make setup`), over the
real folder of the 2-step smoke run: the table, its filters, one rollout's turns with every trained token marked
exactly where the trace's loss mask is 1, the static export opened from disk, and a folder that is not a run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from selenium.webdriver.common.keys import Keys

from harness_trainer._exceptions import ViewerError
from harness_trainer.commands.viewer.runs import Decoder, RunFolder, find_runs

HARNESS_TRAIN = [sys.executable, "-m", "harness_trainer.commands.cli"]
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and DRIVER):
        pytest.skip("chromium and chromium-driver are not installed: `make setup` installs them as root "
                    "(apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1400,1800"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(DRIVER))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def served(smoke_run):
    """`harness-train view RUN --port 0`, as a user starts it; its URL from what it prints."""
    proc = subprocess.Popen(HARNESS_TRAIN + ["view", str(smoke_run), "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = ""
    for line in proc.stdout:
        if line.startswith("open http://"):
            break
    assert line.startswith("open http://"), proc.stderr.read()
    yield line.split()[1]
    proc.terminate()
    proc.wait(timeout=30)


def _wait(driver, script: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(script)
        if value:
            return value
        error = driver.execute_script(
            "const e = document.getElementById('error'); return e.hidden ? '' : e.textContent")
        assert not error, error
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for: {script}")


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]


def _traces(run: Path) -> dict[str, dict]:
    traces = [json.loads(line) for line in (run / "traces.jsonl").read_text().splitlines()]
    return {t["turns"][0]["metadata"]["episode_id"]: t for t in traces}


def _visible_tasks(driver) -> list[str]:
    return driver.execute_script("return [...document.querySelectorAll('#rollout-table tbody tr[data-rollout]')]"
                                 ".map(tr => tr.children[1].textContent)")


def _check_turns(driver, trace: dict) -> None:
    """Every loaded token of every turn: a trained mark exactly where the loss mask is 1, sampled tokens exactly
    where the completion is; and the whole turn once its earlier context is asked for. A turn's tokens load when
    it scrolls into view, so each is scrolled to."""
    assert driver.execute_script("return document.querySelectorAll('.turn').length") == len(trace["turns"])
    for j, turn in enumerate(trace["turns"]):
        mask, prompt = turn["loss_mask"], len(turn["prompt_token_ids"])
        driver.execute_script(f"document.getElementById('turn-{j}').scrollIntoView()")
        _wait(driver, f"return document.getElementById('turn-{j}').dataset.loaded === 'true'")
        while driver.execute_script(f"return !!document.querySelector('#turn-{j} .earlier-button')"):
            before = driver.execute_script(f"return document.querySelectorAll('#turn-{j} .tok').length")
            driver.execute_script(f"document.querySelector('#turn-{j} .earlier-button').click()")
            _wait(driver, f"return document.querySelectorAll('#turn-{j} .tok').length > {before}")
        shown = driver.execute_script(
            f"return [...document.querySelectorAll('#turn-{j} .tok')].map(s => [+s.dataset.pos, "
            "s.classList.contains('trained'), s.classList.contains('sampled')])")
        assert [pos for pos, _, _ in shown] == list(range(len(mask)))
        assert [pos for pos, trained, _ in shown if trained] == [k for k, m in enumerate(mask) if m == 1]
        assert [pos for pos, _, sampled in shown if sampled] == list(range(prompt, len(mask)))


def test_the_viewer_shows_the_smoke_run_in_a_real_browser(smoke_run, served, browser, tmp_path):
    records, traces = _records(smoke_run), _traces(smoke_run)
    # what the run folder now keeps for the viewer: the call graph, the verifier's output, ids only in traces.jsonl
    assert all("trace" not in r["outcome"] and r["calls"] for r in records)
    assert all(r["turns"] == len(traces[r["episode_id"]]["turns"]) for r in records if r["episode_id"] in traces)
    browser.get(served)
    _wait(browser,
          f"return document.querySelectorAll('#rollout-table tbody tr[data-rollout]').length === {len(records)}")
    assert sorted(_visible_tasks(browser)) == sorted(r["task"] for r in records)
    assert _wait(browser, "return document.querySelectorAll('#charts .chart').length") >= 3  # reward, groups, sync...
    titles = browser.execute_script("return [...document.querySelectorAll('#charts .gtitle')].map(t => t.textContent)")
    assert {"Where the time goes (s), per step", "Idle and overlap, per step"} <= set(titles), titles

    # filtering: by task (the select), then by the search box
    task = records[0]["task"]
    browser.execute_script(f"const s = document.getElementById('filter-task'); s.value = {json.dumps(task)};"
                           "s.dispatchEvent(new Event('change'))")
    _wait(browser, f"return document.querySelectorAll('#rollout-table tbody tr[data-rollout]').length === "
                   f"{sum(r['task'] == task for r in records)}")
    assert set(_visible_tasks(browser)) == {task}
    browser.execute_script(
        "const s = document.getElementById('filter-task'); s.value = ''; s.dispatchEvent(new Event('change'))")
    other = next(r["task"] for r in records if r["task"] != task)
    search = browser.find_element("css selector", "#rollouts input[type=search]")
    search.send_keys(other)
    _wait(browser, f"return [...document.querySelectorAll('#rollout-table tbody tr[data-rollout]')]"
                   f".every(tr => tr.children[1].textContent === {json.dumps(other)})")
    search.clear()
    search.send_keys("x", Keys.BACKSPACE)  # clear() fires no input event; this does, with an empty search
    _wait(browser,
          f"return document.querySelectorAll('#rollout-table tbody tr[data-rollout]').length === {len(records)}")

    # open a rollout with turns by clicking its row
    i = next(k for k, r in enumerate(records) if r["episode_id"] in traces)
    browser.execute_script(f"document.querySelector('#rollout-table tr[data-rollout=\"{i}\"]').click()")
    _wait(browser, "return !document.getElementById('rollout').hidden")
    trace = traces[records[i]["episode_id"]]
    _check_turns(browser, trace)
    assert _wait(browser, "return document.querySelectorAll('#graph .point').length") == len(records[i]["calls"])
    browser.execute_script("document.getElementById('conversation').scrollIntoView()")  # loads when shown
    _wait(browser, f"return document.querySelectorAll('#conversation .message').length === "
                   f"{len(records[i]['outcome']['completion'])}")
    assert "reward" in browser.find_element("id", "verifier").text
    shot = tmp_path / "viewer.png"
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 20_000


def test_the_static_export_opens_from_disk(smoke_run, browser, tmp_path):
    out = tmp_path / "html"
    result = subprocess.run(HARNESS_TRAIN + ["view", str(smoke_run), "--html", str(out)], capture_output=True,
                            text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    records, traces = _records(smoke_run), _traces(smoke_run)
    i = next(k for k, r in enumerate(records) if r["episode_id"] in traces)
    browser.get((out / "index.html").as_uri() + f"#r0/{i}")  # file://: no server, data from <script> files
    _wait(browser,
          f"return document.querySelectorAll('#rollout-table tbody tr[data-rollout]').length === {len(records)}")
    _check_turns(browser, traces[records[i]["episode_id"]])


def test_a_folder_that_is_not_a_run_is_a_clear_error(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    result = subprocess.run(HARNESS_TRAIN + ["view", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "is not a run folder" in result.stderr and "--output-dir" in result.stderr
    result = subprocess.run(HARNESS_TRAIN + ["view", str(tmp_path / "missing")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1 and "does not exist" in result.stderr
    with pytest.raises(ViewerError, match="is a file"):
        find_runs(tmp_path / "notes.txt")


def test_the_index_follows_a_growing_run_and_reads_older_records(smoke_run, tmp_path):
    """A live run appends: a half-written line waits, a whole one joins the table. A record written before
    rollouts.jsonl left the ids to traces.jsonl (its turns in outcome.trace) gets the same row and turns."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(smoke_run / "traces.jsonl", run / "traces.jsonl")
    records, traces = _records(smoke_run), _traces(smoke_run)
    folder = RunFolder(run, Decoder(None))
    assert len(folder.rows) == len(traces) and all(r["status"] == "trace" for r in folder.rows)  # traces alone

    (run / "rollouts.jsonl").write_text("")
    folder = RunFolder(run, Decoder(None))
    old = dict(records[0])
    old["outcome"] = old["outcome"] | {"trace": traces.get(old["episode_id"], {"turns": []})["turns"]}
    for key in ("turns", "sampled_tokens", "trained_tokens", "context_tokens", "calls"):
        old.pop(key)
    line = json.dumps(old) + "\n"
    with (run / "rollouts.jsonl").open("a") as f:
        f.write(line[:100])
    folder.refresh()
    assert folder.rows == []
    with (run / "rollouts.jsonl").open("a") as f:
        f.write(line[100:] + json.dumps(records[1]) + "\n")
    folder.refresh()
    assert [r["episode_id"] for r in folder.rows] == [records[0]["episode_id"], records[1]["episode_id"]]
    assert folder.rows[0]["turns"] == records[0]["turns"]
    assert folder.rows[0]["trained_tokens"] == records[0]["trained_tokens"]
    assert [t["j"] for t in folder.rollout(0)["turns"]] == list(range(records[0]["turns"]))
