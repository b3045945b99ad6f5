"""The house follows the data path: the import layering (import-linter's contracts in pyproject.toml), the
package tree the docs show, the generated CLI reference, and the size of a file. No engine, no network."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "harness_trainer"
LISTED = (".py", ".c", ".jinja", ".yaml", ".json", ".md")  # what the tree lists (examples/ is listed as one line)


def test_import_contracts_are_kept():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert lint, "lint-imports is missing: `make setup` installs import-linter (the test extra)"
    result = subprocess.run([lint, "--no-cache"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout and "no import cycles" in result.stdout


def test_ruff_finds_nothing():
    """Lint and import order (pyproject.toml: [tool.ruff]); `ruff check --fix .` mends most of what it finds."""
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is missing: `make setup` installs it (the test extra)"
    result = subprocess.run([ruff, "check", "--no-cache", "."], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


@pytest.mark.parametrize("package", sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py")))
def test_each_package_docstring_names_every_module_it_holds(package):
    doc = (PACKAGE / package / "__init__.py").read_text()
    missing = [m.name for m in sorted((PACKAGE / package).glob("*.py"))
               if m.name != "__init__.py" and m.name not in doc]
    assert not missing, f"harness_trainer/{package}/__init__.py does not say what these hold: {missing}"


def _tree(doc: Path) -> set[str]:
    """The paths of the indented tree under `harness_trainer/` in a markdown file."""
    paths, stack = set(), []
    lines = doc.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "harness_trainer/")
    for line in lines[start + 1:]:
        if not line.startswith("      ") or not line.strip():
            break
        depth = (len(line) - len(line.lstrip()) - 6) // 2
        name = line.split()[0]
        stack[depth:] = [name.rstrip("/")]
        paths.add("/".join(stack) + ("/" if name.endswith("/") else ""))
    return paths


def _code() -> set[str]:
    found = set()
    for path in PACKAGE.rglob("*"):
        rel = path.relative_to(PACKAGE)
        if "__pycache__" in rel.parts or "static" in rel.parts or rel.parts[0] == "examples" and len(rel.parts) > 1:
            continue
        if path.is_dir():
            found.add(f"{rel}/")
        elif path.suffix in LISTED and path.name != "__init__.py" or rel == Path("__init__.py"):
            found.add(str(rel))
    return found


def test_the_design_tree_lists_exactly_the_modules_the_code_has():
    listed, code = _tree(REPO / "docs" / "design" / "README.md"), _code()
    assert not code - listed, f"in the code but not in docs/design/README.md: {sorted(code - listed)}"
    assert not listed - code, f"in docs/design/README.md but not in the code: {sorted(listed - code)}"


def test_the_readme_names_every_package_and_links_only_to_docs_that_exist():
    readme = (REPO / "README.md").read_text()
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    missing = [p for p in sorted(packages) if f"{p}/" not in readme]
    assert not missing, f"README's package index lacks {missing}"
    for link in re.findall(r"\]\(((?:docs/)?[\w/.-]+\.(?:md|png))\)", readme):
        assert (REPO / link).exists(), f"README links to {link}, which does not exist"
    assert len(readme.splitlines()) <= 250, \
        "the README is the user's path: keep it within 250 lines (docs/ for the rest)"


def test_docs_link_only_to_pages_that_exist():
    for page in (REPO / "docs").rglob("*.md"):
        for link in re.findall(r"\]\(([\w/.-]+\.(?:md|png))\)", page.read_text()):
            assert (page.parent / link).resolve().exists(), f"{page.relative_to(REPO)} links to missing {link}"


def test_the_cli_reference_is_generated_from_the_configs():
    from harness_trainer.commands.reference import reference

    assert (REPO / "docs" / "cli.md").read_text() == reference(), \
        "docs/cli.md is stale: run `make docs` (python -m harness_trainer.commands.reference > docs/cli.md)"


# Files allowed past ~400 lines, each with its reason.
LONG_FILES: dict[str, str] = {}


@pytest.mark.parametrize("folder", ["harness_trainer", "bench", "scripts"])
def test_no_file_past_400_lines_without_a_reason(folder):
    long = {str(p.relative_to(REPO)): n for p in (REPO / folder).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400 and str(p.relative_to(REPO)) not in LONG_FILES}
    assert not long, f"split these (or give a reason in LONG_FILES): {long}"


def test_no_function_past_60_lines():
    """An algorithm read in one sitting: a function (its docstring included) past 60 lines is split."""
    import ast

    long = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long[f"{path.relative_to(REPO)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert not long, f"split these: {long}"


def test_a_value_outside_a_fixed_set_is_refused_in_words_written_once():
    """harness_trainer/choices.py words every such refusal ("--flag 'value': choose a, b or c"); no module writes
    its own list of choices into a message."""
    own = [f"{p.relative_to(REPO)}:{n}" for p in sorted(PACKAGE.rglob("*.py")) if p.name != "choices.py"
           for n, line in enumerate(p.read_text().splitlines(), 1)
           if re.search(r"choose one of|must be one of|use one of|(choose|one of) \{.*join\(", line)]
    assert own == [], f"write these with choices.choose / refused: {own}"
