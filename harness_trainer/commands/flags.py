"""One CLI vocabulary: every command's flags are generated from its config dataclass, so a setting has one
name everywhere (`--num-generations` in train and eval), as TRL's HfArgumentParser does:

    field `max_step_kl`   ->  --max-step-kl and --max_step_kl, and the --config YAML key max_step_kl
    bool fields           ->  --use-peft (true), --use-peft true|false
    `int | None` fields   ->  a number, or none / off
    defaults < --config file < flags given on the command line

Old spellings users may have in scripts (`eval -n`, `--concurrency`, `--max-tokens`, `--resume`, ...) still
work and print one deprecation line naming the new flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from pathlib import Path

import yaml

from harness_trainer._exceptions import ConfigError
from harness_trainer.choices import flag, one_of


def parse_bool(text) -> bool:
    if isinstance(text, bool):
        return text
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def parse_optional_float(text) -> float | None:
    return None if text is None or str(text).strip().lower() in ("none", "off") else float(text)


def parse_optional_int(text) -> int | None:
    return None if text is None or str(text).strip().lower() in ("none", "off") else int(text)


def parse_optional_bool(text) -> bool | None:
    return None if text is None or str(text).strip().lower() in ("none", "auto") else parse_bool(text)


# field type (a string: the modules use `from __future__ import annotations`) -> converter
CONVERTERS = {"int": int, "float": float, "float | None": parse_optional_float, "int | None": parse_optional_int,
              "bool": parse_bool, "bool | None": parse_optional_bool}


def help_of(f: dataclasses.Field) -> str:
    """A field's help, naming every value it may take where it has a fixed set the text leaves some out of."""
    text, choices = f.metadata.get("help", ""), f.metadata.get("choices")
    if choices and not all(str(choice) in text for choice in choices):
        text += f" (choose {one_of(choices)})"
    return text


def fields_of(config_cls, skip: tuple[str, ...] = ()) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(config_cls) if f.name not in skip}


def add_config_flags(parser: argparse.ArgumentParser, config_cls, skip: tuple[str, ...] = (),
                     deprecated: dict[str, str] | None = None) -> None:
    """One flag per field (both spellings); unset flags stay absent so a --config file can fill them.
    `deprecated`: old flag -> field name."""
    parser.add_argument("--config", default=None, help="YAML file whose keys are these options' names "
                        "(max_steps: 10); flags given here override it")
    for name, f in fields_of(config_cls, skip).items():
        kind = str(f.type)
        default = "" if f.default in (None, dataclasses.MISSING) else f" (default: {f.default})"
        extra = dict(nargs="?", const=True) if kind in ("bool", "bool | None") else {}
        if f.metadata.get("repeat"):  # --vllm-url A --vllm-url B
            extra["action"] = "append"
        if f.metadata.get("required"):
            extra["required"] = True
        shown = argparse.SUPPRESS if f.metadata.get("deprecated") else help_of(f) + default
        parser.add_argument(flag(name), dest=name, type=CONVERTERS.get(kind, str), default=argparse.SUPPRESS,
                            help=shown, **extra)
        if "_" in name:  # HfArgumentParser's other spelling; its own action, so messages name the flag once
            parser.add_argument(f"--{name}", dest=name, type=CONVERTERS.get(kind, str), default=argparse.SUPPRESS,
                                help=argparse.SUPPRESS, **extra)
    for old, name in (deprecated or {}).items():
        kind = str(fields_of(config_cls)[name].type)
        extra = dict(nargs="?", const=True) if kind in ("bool", "bool | None") else {}
        parser.add_argument(old, dest=name, type=CONVERTERS.get(kind, str), default=argparse.SUPPRESS,
                            action=Deprecated, new=flag(name), help=argparse.SUPPRESS, **extra)


class Deprecated(argparse.Action):
    def __init__(self, option_strings, dest, new: str, **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"harness-train: {option_string} is deprecated and will be removed: use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def load_config_file(path: str | Path, config_cls, deprecated: dict[str, str] | None = None) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path} must be a mapping of option names to values, e.g. `max_steps: 10`")
    fields = fields_of(config_cls)
    normalised = {str(k).replace("-", "_"): v for k, v in data.items()}
    for old, name in (deprecated or {}).items():  # an old flag's key, e.g. `resume:`
        key = old.lstrip("-").replace("-", "_")
        if key in normalised and key not in fields:
            print(f"harness-train: --config {path}: {key} is deprecated and will be removed: use {name}",
                  file=sys.stderr)
            normalised[name] = normalised.pop(key)
    unknown = sorted(set(normalised) - set(fields))
    if unknown:
        hints = [f"{u} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(u, fields, 1)) else u
                 for u in unknown]
        raise ConfigError(f"--config {path}: unknown option(s) {', '.join(hints)}; the keys are the flag names: "
                          f"{', '.join(sorted(fields))}")
    for name, value in normalised.items():  # YAML 1.1 reads 1e-3 as a string: coerce numbers by the field's type
        kind = CONVERTERS.get(str(fields[name].type))
        if kind and value is not None and not isinstance(value, bool):
            try:
                normalised[name] = kind(value)
            except (TypeError, ValueError):
                raise ConfigError(f"--config {path}: {name} must be a {fields[name].type}, got {value!r}") from None
    return normalised


def config_values(args: argparse.Namespace, config_cls, deprecated: dict[str, str] | None = None) -> dict:
    """Defaults < --config file < flags given on the command line: the values to build `config_cls` from."""
    file_values = load_config_file(args.config, config_cls, deprecated) if getattr(args, "config", None) else {}
    return file_values | {name: getattr(args, name) for name in fields_of(config_cls) if hasattr(args, name)}


def build_config(config_cls, values: dict):
    """`config_cls(**values)`, its own checks (__post_init__) answered as a ConfigError, not a traceback."""
    try:
        return config_cls(**values)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


class ArgumentParser(argparse.ArgumentParser):
    """argparse that answers a mistyped flag or command with the nearest real one. No prefix matching: a flag
    is spelt out, so a later flag never changes what an old abbreviation meant."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        words = message.split()
        if message.startswith("unrecognized arguments:"):
            options = sorted(_options(self))
            hints = []
            for arg in words[2:]:
                if arg.startswith("-") and (match := difflib.get_close_matches(arg.split("=")[0], options, 1)):
                    hints.append(f"{arg}: did you mean {match[0]}?")
            if hints:
                message += " (" + "; ".join(hints) + ")"
        super().error(message)


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """Every --flag of a parser and its subcommands (an unknown flag of a subcommand is reported by the top)."""
    found = set()
    for action in parser._actions:
        found.update(o for o in action.option_strings if o.startswith("--") and action.help != argparse.SUPPRESS)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _options(sub)
    return found
