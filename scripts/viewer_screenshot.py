"""The README's viewer figure: `python scripts/viewer_screenshot.py runs/demo docs/viewer.png --open r0/112`.

Serves RUN_DIR with the viewer, opens it in headless chromium (make setup installs it), optionally opens a
rollout (#RUN/ROLLOUT), waits for its turns and writes a screenshot.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness_trainer.commands.viewer.serve import Viewer, make_server  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("out")
    parser.add_argument("--open", default="", help="RUN/ROLLOUT to open, e.g. r0/12")
    parser.add_argument("--size", default="1400,1500", help="window width,height in pixels")
    args = parser.parse_args()
    server = make_server(Viewer(args.run_dir), port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    options = Options()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 f"--window-size={args.size}", "--hide-scrollbars"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))
    try:
        driver.get(f"http://127.0.0.1:{server.server_address[1]}/#{args.open}")
        deadline = time.monotonic() + 60
        done = ("return document.querySelector('.turn[data-loaded=true]') !== null" if args.open
                else "return document.querySelectorAll('#rollout-table tbody tr').length > 0")
        while not driver.execute_script(done):
            if time.monotonic() > deadline:
                raise SystemExit("the page did not finish loading")
            time.sleep(0.2)
        time.sleep(1.0)  # plotly's transitions
        if args.open:  # the rollout from its call graph down
            driver.execute_script("document.getElementById('graph').previousElementSibling.scrollIntoView()")
            time.sleep(0.5)
        driver.save_screenshot(args.out)
    finally:
        driver.quit()
        server.shutdown()
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
