"""docs/cli.md, generated from the parser that `harness-train` itself uses (its flags come from the config
dataclasses' fields, commands/flags.py): `python -m harness_trainer.commands.reference > docs/cli.md`, or
`make docs`. tests/test_layout.py fails when the file is stale."""

from __future__ import annotations

import argparse

HEADER = """# CLI reference

Generated from the config dataclasses by `make docs` (`python -m harness_trainer.commands.reference`); do not
edit by hand. Every `--a-b` flag is also accepted as `--a_b`; a train, eval or sft flag is also a key of a
`--config` YAML file (`a_b: value`; flags given on the command line win). Booleans: `--flag` alone is true,
`--flag true|false` sets it. `none` (or `off`) unsets a setting that can be unset.
"""


def _rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| flag | default | what |", "|---|---|---|"]
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, (argparse._HelpAction,
                                                                   argparse._SubParsersAction)):
            continue
        names = action.option_strings or [action.dest]
        text = (action.help or "").split(" (default: ")[0].replace("|", "\\|")
        default = action.default if action.default not in (None, argparse.SUPPRESS) else ""
        if not default and "(default: " in (action.help or ""):
            default = action.help.rsplit("(default: ", 1)[1].rstrip(")")
        if action.required:
            default = "required"
        rows.append(f"| `{', '.join(names)}` | {f'`{default}`' if default != '' else ''} | {text} |")
    return rows


def reference() -> str:
    from harness_trainer.commands.cli import build_parser

    parser = build_parser()
    out = [HEADER]

    def walk(p: argparse.ArgumentParser, name: str) -> None:
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if name:
            out.append(f"## `{name}`\n")
            if p.description:
                out.append(p.description + "\n")
            if len(p._actions) > 1:
                out.append("\n".join(_rows(p)) + "\n")
        for sub in subs:
            for command, child in sub.choices.items():
                if child.add_help:  # `proxy` hands over to the proxy's own parser
                    walk(child, f"{name} {command}".strip())

    walk(parser, "")
    return "\n".join(out).replace("\n\n\n", "\n\n")


if __name__ == "__main__":
    print(reference(), end="")
