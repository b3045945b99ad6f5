"""`harness-train model ...` and `harness-train serve`: the commands about one model. `model tiny` builds an
embedded default, `model check` says what a run would do with a folder or Hub id, `serve` starts vLLM for it.
Imports stay inside the commands, as in cli.py."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness_trainer.commands.flags import Deprecated
from harness_trainer.models.tiny import ARCHS


def _model_tiny(args: argparse.Namespace) -> int:
    from harness_trainer.models.tiny import TinyModelSpec, ensure_tiny_model

    spec = TinyModelSpec(arch=args.arch, tie_embeddings=args.tie_embeddings, layers=args.layers,
                         hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                         intermediate=args.intermediate, vocab=args.vocab, seed=args.seed)
    out = ensure_tiny_model(spec, args.output_dir)
    print(out)
    return 0


def _model_check(args: argparse.Namespace) -> int:
    """What a run would do with this model, checked before any GPU is touched (README "Bring your own model")."""
    from harness_trainer.models.formats import detect_formats, ties_embeddings
    from harness_trainer.models.hub import resolve_model

    model = resolve_model(args.model, model_flag(args, "model_revision"))
    formats = detect_formats(model.path, model_flag(args, "tool_call_parser"), model_flag(args, "reasoning_parser"),
                             named=model.name)
    tied = ties_embeddings(model.path)
    for key, value in (("model", model.name + (f" @ {model.revision}" if model.revision else "")),
                       ("folder", model.path), ("formats", formats.describe()),
                       ("context", f"{formats.max_model_len or 'unknown (give --max-model-len)'} tokens"),
                       ("embeddings", "tied (lm_head is the input embedding: the weight sync updates both)" if tied
                        else "untied")):
        print(f"{key:11} {value}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from harness_trainer.models.hub import resolve_model
    from harness_trainer.serving.engine import EngineConfig, VLLMServer, model_formats
    from harness_trainer.serving.process import ignore_stop_signals

    model = resolve_model(args.model, model_flag(args, "model_revision"))
    cfg = EngineConfig(model=str(model.path), served_model_name=args.served_model_name or model.name, host=args.host,
                       port=args.port, max_model_len=model_flag(args, "max_model_len"),
                       tool_call_parser=model_flag(args, "tool_call_parser"),
                       reasoning_parser=model_flag(args, "reasoning_parser"), startup_timeout_s=args.startup_timeout,
                       log_path=Path(args.log) if args.log else None)
    formats = model_formats(cfg)  # a model whose formats cannot be told fails here, before vLLM starts
    with VLLMServer(cfg) as server:
        print(f"vLLM serving {args.model} as '{cfg.served_model_name}' at {server.url}/v1 ({formats.describe()}; "
              f"log: {cfg.log_path}); Ctrl-C stops it", flush=True)
        try:
            server.process.wait()
        except KeyboardInterrupt:
            ignore_stop_signals()  # after the `with` stops vLLM, exit 0 rather than -2 (serving/process.py)
        if server.process and server.process.returncode not in (None, 0):
            print(f"vLLM exited with code {server.process.returncode}:\n{server.log_tail()}", file=sys.stderr)
            return 1
    return 0


MODEL_FLAGS = ("model_revision", "tool_call_parser", "reasoning_parser", "max_model_len")


def add_model_flags(parser: argparse.ArgumentParser, serving: bool = True) -> None:
    """train/eval's model flags (RolloutConfig's fields: one name and one help text everywhere), for the
    commands whose other flags are not a config's; unset ones are absent (read them with model_flag)."""
    from harness_trainer.commands.flags import CONVERTERS, fields_of, flag
    from harness_trainer.rollouts.config import RolloutConfig

    fields = fields_of(RolloutConfig)
    for name in MODEL_FLAGS[:None if serving else 3]:
        parser.add_argument(flag(name), dest=name, type=CONVERTERS.get(str(fields[name].type), str),
                            default=argparse.SUPPRESS, help=fields[name].metadata["help"])


def model_flag(args: argparse.Namespace, name: str):
    return getattr(args, name, None)


def add_model_parsers(sub) -> None:
    model = sub.add_parser("model", help="build the embedded default model")
    model_sub = model.add_subparsers(dest="kind", metavar="KIND", required=True)
    tiny = model_sub.add_parser(
        "tiny", help="a tiny random model (Qwen2, Qwen3 or Llama shaped) with a locally trained tokenizer (cached "
                     "by its parameters)", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    tiny.add_argument("--arch", default="qwen2", choices=ARCHS,
                      help="architecture, with its family's chat template (qwen3: <think> reasoning; llama: Llama 3 "
                           "JSON tool calls)")
    tiny.add_argument("--tie-embeddings", action="store_true", help="tie lm_head to the input embedding")
    tiny.add_argument("--output-dir", default=None, help="directory to write (default: print the cached build's path)")
    tiny.add_argument("--output_dir", dest="output_dir", help=argparse.SUPPRESS)
    tiny.add_argument("--out", dest="output_dir", action=Deprecated, new="--output-dir", help=argparse.SUPPRESS)
    tiny.add_argument("--layers", type=int, default=2, help="transformer layers")
    tiny.add_argument("--hidden", type=int, default=128, help="hidden size")
    tiny.add_argument("--heads", type=int, default=2, help="attention heads")
    tiny.add_argument("--kv-heads", type=int, default=1, help="key/value heads")
    tiny.add_argument("--intermediate", type=int, default=256, help="MLP width")
    tiny.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary size (before added tokens)")
    tiny.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    tiny.set_defaults(func=_model_tiny)

    check = model_sub.add_parser(
        "check", help="resolve a model (folder or Hub id) and print what a run would use: formats, context, "
                      "embeddings", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    check.add_argument("model", help="model folder or Hub id OWNER/NAME")
    add_model_flags(check, serving=False)
    check.set_defaults(func=_model_check)

    serve = sub.add_parser("serve", help="run a vLLM server configured for capture and weight sync",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_argument("--model", required=True, help="model folder or Hub id OWNER/NAME")
    add_model_flags(serve)
    serve.add_argument("--served-model-name", default=None, help="model id the server answers to (default: the "
                                                                 "model's id; 'tiny' for the embedded default)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind")
    serve.add_argument("--port", type=int, default=8000, help="port to bind")
    serve.add_argument("--startup-timeout", type=float, default=300.0,
                       help="seconds to wait for /health with no new line in the engine's log (4x that in all)")
    serve.add_argument("--log", default=None, help="server log file (default: a temporary file)")
    serve.set_defaults(func=_serve)
