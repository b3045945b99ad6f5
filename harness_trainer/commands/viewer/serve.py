"""`harness-train view RUN_DIR`: the run viewer, served over HTTP or written as static files.

The page (static/app.js) asks for every piece of data by a path such as `r0/rollout/12` and receives it as a
small script, `data/r0/rollout/12.js`, which calls `HV.receive(path, data)`. The server answers those scripts
from the run folder as they are asked for; `--html OUT` writes the same scripts to files, so the exported page
works from disk (a browser runs <script src> from file://, where it refuses fetch()) and still loads lazily.

Page libraries come from Python packages the project installs rather than copies in this repository:
DataTables (sorting, filtering, paging over the rollout table) from `itables`, Plotly (curves, the rollout
graph) from `plotly`. Why these: README "Run viewer".
"""

from __future__ import annotations

import json
import re
import shutil
import threading
from functools import cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from urllib.parse import unquote

from harness_trainer._exceptions import ViewerError
from harness_trainer.commands.viewer.runs import CHUNK, Decoder, RunFolder, find_runs, find_tokenizer
from harness_trainer.models.hub import resolve_model

STATIC = ("index.html", "app.js", "app.css")


class Viewer:
    """Every run under one folder, by key (r0, r1, ...), and the data paths the page asks for."""

    def __init__(self, root: str | Path, model: str | Path | None = None):
        self.root = Path(root).resolve()
        paths = find_runs(self.root)
        self.runs: dict[str, RunFolder] = {}
        for n, path in enumerate(paths):
            tokenizer = find_tokenizer(path, self.root, resolve_model(model).path if model else None)
            self.runs[f"r{n}"] = RunFolder(path, Decoder(tokenizer))
        self._lock = threading.Lock()  # one reader of the index at a time (the server is threaded)

    def index(self) -> dict:
        proof = self.root / "proof.json"
        table = json.loads(proof.read_text()).get("table") if proof.is_file() else None
        return {"root": str(self.root), "name": self.root.name, "proof_table": table,
                "runs": [{"key": key, "name": str(run.path.relative_to(self.root)) if run.path != self.root
                          else run.path.name, "rollouts": len(run.rows)} for key, run in self.runs.items()]}

    def get(self, path: str, live: bool = False) -> dict:
        """The document at a data path; KeyError for one that does not exist."""
        parts = path.strip("/").split("/")
        if parts == ["index"]:
            return self.index()
        run = self.runs[parts[0]]
        with self._lock:
            if live:
                run.refresh()
            match parts[1:]:
                case ["overview"]:
                    return run.overview()
                case ["rollouts"]:
                    return {"rows": run.rows}
                case ["rollout", i]:
                    return run.rollout(_index(i, len(run.rows)))
                case ["messages", i]:
                    return run.messages(_index(i, len(run.rows)))
                case ["tokens", i, j, chunk]:
                    return run.tokens(_index(i, len(run.rows)), int(j), int(chunk))
        raise KeyError(path)

    def all_paths(self):
        """Every data path of every run, for the static export."""
        yield "index"
        for key, run in self.runs.items():
            yield from (f"{key}/overview", f"{key}/rollouts")
            for i in range(len(run.rows)):
                yield from (f"{key}/rollout/{i}", f"{key}/messages/{i}")
                for j, turn in enumerate(run.trace_turns(i)):
                    total = len(turn["prompt_token_ids"]) + len(turn["completion_token_ids"])
                    for chunk in range(max(1, -(-total // CHUNK))):
                        yield f"{key}/tokens/{i}/{j}/{chunk}"


def _index(text: str, size: int) -> int:
    i = int(text)
    if not 0 <= i < size:
        raise KeyError(f"no rollout {i}")
    return i


def script(path: str, data) -> bytes:
    return f"HV.receive({json.dumps(path)}, {json.dumps(data, allow_nan=False, default=str)});\n".encode()


def failure(path: str, message: str) -> bytes:
    return f"HV.fail({json.dumps(path)}, {json.dumps(message)});\n".encode()


@cache
def vendor(name: str) -> bytes:
    """The page libraries, read from the installed packages."""
    if name == "plotly.min.js":
        from plotly.offline import get_plotlyjs

        return get_plotlyjs().encode()
    bundle = resources.files("itables") / "html"
    if name == "datatables.css":
        return (bundle / "dt_bundle.css").read_bytes()
    if name == "datatables.js":
        # itables ships DataTables as one ES module; a module file cannot load from file://, so its export
        # statement becomes a global and the whole runs as a classic script (strict, in its own scope).
        source = (bundle / "dt_bundle.js").read_text()
        exports = list(re.finditer(r"export\s*\{([^}]*)\};?", source))
        if len(exports) != 1:
            raise ViewerError("the installed itables' DataTables bundle has an unexpected shape: reinstall with "
                              "`make setup` (the project pins itables)")
        pairs = [item.strip().split(" as ") for item in exports[0].group(1).split(",")]
        names = ", ".join(f"{alias.strip()}: {local.strip()}" for local, alias in pairs)
        body = source[:exports[0].start()] + source[exports[0].end():]
        return f'(function () {{ "use strict";\n{body}\nwindow.DataTablesBundle = {{ {names} }};\n}})();\n'.encode()
    raise KeyError(name)


def static(name: str) -> bytes:
    return (resources.files("harness_trainer.commands.viewer") / "static" / name).read_bytes()


def export_html(viewer: Viewer, out: str | Path) -> Path:
    """The page and every data script, written to `out`; open out/index.html in a browser."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not (out / "index.html").exists():
        raise ViewerError(f"{out} exists and is not an earlier export: give an empty or new folder to --html")
    shutil.rmtree(out / "data", ignore_errors=True)
    for name in STATIC:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(static(name))
    (out / "vendor").mkdir(exist_ok=True)
    for name in ("plotly.min.js", "datatables.js", "datatables.css"):
        (out / "vendor" / name).write_bytes(vendor(name))
    for path in viewer.all_paths():
        target = out / "data" / f"{path}.js"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(script(path, viewer.get(path)))
    return out / "index.html"


CONTENT = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css"}


def make_server(viewer: Viewer, host: str = "127.0.0.1", port: int = 8765) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            route = unquote(self.path.split("?")[0]).lstrip("/") or "index.html"
            status = 200
            try:
                if route.startswith("data/") and route.endswith(".js"):
                    path = route[5:-3]
                    try:
                        body = script(path, viewer.get(path, live=True))
                    except (KeyError, ValueError, IndexError) as exc:
                        status, body = 404, failure(path, f"no such data: {path} ({exc})")
                elif route.startswith("vendor/"):
                    body = vendor(route[7:])
                elif route in STATIC:
                    body = static(route)
                else:
                    raise KeyError(route)
            except KeyError:
                status, body, route = 404, b"not found\n", "x.txt"
            self.send_response(status)
            self.send_header("content-type", CONTENT.get(Path(route).suffix, "text/plain; charset=utf-8"))
            self.send_header("content-length", str(len(body)))
            self.send_header("cache-control", "no-store" if route.startswith("data/") else "max-age=3600")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # quiet: the command prints its URL, not every request
            pass

    return ThreadingHTTPServer((host, port), Handler)
