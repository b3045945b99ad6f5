"""`harness-train`: a thin shell over the Python API. Imports stay inside the commands, so `--help` is fast
and the proxy's light environment (no torch) can run the commands it needs."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import signal
import sys
import threading
from pathlib import Path


def _model_tiny(args: argparse.Namespace) -> int:
    from harness_trainer.tiny_model import TinyModelSpec, ensure_tiny_model

    spec = TinyModelSpec(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                         intermediate=args.intermediate, vocab=args.vocab, seed=args.seed)
    out = ensure_tiny_model(spec, args.out)
    print(out)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from harness_trainer.engine import EngineConfig, VLLMServer

    cfg = EngineConfig(model=args.model, served_model_name=args.served_model_name, host=args.host,
                       port=args.port, max_model_len=args.max_model_len, startup_timeout_s=args.startup_timeout,
                       log_path=Path(args.log) if args.log else None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # SIGTERM -> finally: stop the engine's group
    with VLLMServer(cfg) as server:
        print(f"vLLM serving {args.model} as '{cfg.served_model_name}' at {server.url}/v1 "
              f"(log: {cfg.log_path}); Ctrl-C stops it", flush=True)
        try:
            server.process.wait()
        except KeyboardInterrupt:
            pass
        if server.process and server.process.returncode not in (None, 0):
            print(f"vLLM exited with code {server.process.returncode}:\n{server.log_tail()}", file=sys.stderr)
            return 1
    return 0


def _eval(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from harness_trainer.evaluate import EvalConfig, evaluate

    cfg = EvalConfig(harness=args.harness, dataset=args.dataset, model=args.model, vllm_url=args.vllm_url,
                     policy=args.policy, n=args.n, limit=args.limit, concurrency=args.concurrency,
                     sandbox=args.sandbox, step_limit=args.agent_step_limit, agent_timeout_s=args.agent_timeout,
                     temperature=args.temperature, max_tokens=args.max_tokens, reward_key=args.reward_key,
                     output_dir=args.output_dir, agent_command=args.agent_command, agent_config=args.agent_config,
                     oracle_mistake_rate=args.oracle_mistake_rate, environment=args.environment,
                     reward_funcs=args.reward_funcs, max_tool_calling_iterations=args.max_tool_calling_iterations,
                     max_completion_length=args.max_completion_length)
    counts = {"ok": 0, "timeout": 0, "unscorable": 0, "wins": 0}
    with Progress(TextColumn("[bold]eval[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                  TimeElapsedColumn()) as bar:
        task_id = bar.add_task("starting engine and proxy", total=None)

        def progress(record, done, total):
            counts[record.status] = counts.get(record.status, 0) + 1
            counts["wins"] += int((record.outcome.env_reward or 0) >= 1.0)
            bar.update(task_id, completed=done, total=total, description=(
                f"wins {counts['wins']}  timeouts {counts['timeout']}  unscorable {counts['unscorable']}"))
        summary, _ = evaluate(cfg, progress)
    print(summary.table(f"{args.environment or args.harness} on {args.dataset} (policy: {args.policy})"))
    print(f"traces and rollouts in {args.output_dir}")
    return 0


def _sft(args: argparse.Namespace) -> int:
    from harness_trainer.sft import SFTRunConfig, run_sft

    final = run_sft(SFTRunConfig(traces=args.traces, model=args.model, output_dir=args.output_dir,
                                 num_train_epochs=args.epochs, learning_rate=args.learning_rate,
                                 per_device_train_batch_size=args.batch_size, only_rewarded=args.only_rewarded,
                                 seed=args.seed, use_peft=args.use_peft, lora_rank=args.lora_rank,
                                 lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                                 lora_target_modules=args.lora_target_modules.split(",")
                                 if args.lora_target_modules else None))
    print(f"SFT model (Hugging Face format, servable by vLLM): {final}")
    return 0


class TrainProgress:
    """The live display: a trainer callback (on_rollout, on_step) rendered with rich."""

    def __init__(self, max_steps: int):
        self.max_steps, self.step, self.version, self.tokens, self.launched = max_steps, 0, 0, 0, 0
        self.done: dict[str, int] = {}
        self.reward = self.sync_s = None
        self.stability: dict = {}
        self.warning: str | None = None
        self.recovered: str | None = None

    def on_launch(self, count: int) -> None:
        self.launched += count

    def on_rollout(self, record) -> None:
        status = getattr(record, "status", "error")
        self.done[status] = self.done.get(status, 0) + 1

    def on_step(self, metrics: dict) -> None:
        self.step, self.version = metrics["step"], metrics["version"]
        self.tokens += metrics.get("trained_tokens", 0)
        self.reward = metrics.get("reward_mean", self.reward)
        self.sync_s = metrics.get("weight_sync_time_s", self.sync_s)
        if "entropy" in metrics:
            self.stability = metrics
        if metrics.get("warnings"):
            self.warning = f"step {self.step}: " + "; ".join(metrics["warnings"])
        if metrics.get("recovered"):  # a restarted engine or proxy, put back (supervise.py)
            self.recovered = f"before step {self.step}: " + "; ".join(metrics["recovered"])

    def __rich__(self):
        from rich.table import Table

        table = Table.grid(padding=(0, 2))
        failed = ", ".join(f"{k} {v}" for k, v in sorted(self.done.items()) if k != "ok") or "none"
        reward = f"{self.reward:.3f}" if self.reward is not None else "-"
        sync = f"{self.sync_s * 1000:.0f} ms" if self.sync_s is not None else "-"
        for key, value in (("step", f"{self.step} / {self.max_steps}"),
                           ("rollouts", f"in flight {self.launched - sum(self.done.values())}   "
                                        f"ok {self.done.get('ok', 0)}   not ok: {failed}"),
                           ("reward (last step)", reward), ("tokens trained", self.tokens),
                           ("policy version", self.version), ("last weight sync", sync)):
            table.add_row(f"[bold]{key}[/]", str(value))
        if m := self.stability:
            taken = f"{m['step_scale']:.0%}" if "step_scale" in m else "all"
            table.add_row("[bold]stability[/]", f"entropy {m['entropy']:.3f}   KL to behaviour "
                          f"{m['behaviour_kl_k3']:.4f}   step taken {taken}   behaviour clip "
                          f"{m['behaviour_clip_frac']:.1%}   answer {m.get('completion_tokens_mean') or 0:.0f} tokens")
        if self.warning:
            table.add_row("[bold yellow]warning[/]", f"[yellow]{self.warning}[/]")
        if self.recovered:
            table.add_row("[bold yellow]recovered[/]", f"[yellow]{self.recovered}[/]")
        return table


def train_config(args: argparse.Namespace):
    """Defaults < --config file < flags given on the command line."""
    from harness_trainer.train import FIELDS, load_config_file, resolve_config

    file_values = load_config_file(args.config) if args.config else {}
    return resolve_config(file_values, {name: getattr(args, name) for name in FIELDS if hasattr(args, name)})


def _view(args: argparse.Namespace) -> int:
    from harness_trainer.viewer.serve import Viewer, export_html, make_server

    viewer = Viewer(args.run_dir, model=args.model)
    if args.html:
        page = export_html(viewer, args.html)
        print(f"wrote the viewer for {viewer.root} to {page.parent}: open {page} in a browser")
        return 0
    try:
        server = make_server(viewer, args.host, args.port)
    except OSError as exc:
        print(f"harness-train view: cannot listen on {args.host}:{args.port} ({exc.strerror}): pass another "
              "--port (0 picks a free one)", file=sys.stderr)
        return 1
    host, port = server.server_address[:2]
    runs = ", ".join(f"{r.path.name} ({len(r.rows)} rollouts)" for r in viewer.runs.values())
    print(f"viewing {viewer.root}: {runs}\nopen http://{host}:{port}/ (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _train(args: argparse.Namespace) -> int:
    from rich.live import Live
    from transformers.utils import logging as hf_logging

    from harness_trainer.train import run_training

    cfg = train_config(args)
    # `kill -USR1 <pid>` prints every thread's stack to stderr: where a run is stuck, without stopping it
    with contextlib.suppress(AttributeError, ValueError, OSError):  # no real stderr (embedded, captured)
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    hf_logging.disable_progress_bar()  # one live display, not a bar per checkpoint
    progress = TrainProgress(cfg.max_steps)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        with Live(progress, refresh_per_second=2, transient=False):
            summary = run_training(cfg, callbacks=[progress])
    except KeyboardInterrupt:
        print(f"harness-train: interrupted; engine, proxy and sandboxes are stopped. Checkpoints are in "
              f"{cfg.output_dir}: continue with --resume latest", file=sys.stderr)
        return 130
    print(f"\ndone: {summary['steps']} steps, reward {summary['reward_first']} -> {summary['reward_last']}; "
          f"model {summary['final_model']}, curve {summary['reward_curve']}")
    return 0


def _add_train_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainRunConfig field; unset flags stay absent so a --config file can fill them."""
    from harness_trainer.train import FIELDS, NUMBER_TYPES

    parser.add_argument("--config", default=None, help="YAML file whose keys are these options' names "
                        "(max_steps: 10); flags given here override it")
    for name, f in FIELDS.items():
        default = "" if f.default is None else f" (default: {f.default})"
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=NUMBER_TYPES.get(str(f.type), str),
                            default=argparse.SUPPRESS, help=f.metadata["help"] + default)


def _jobs(args: argparse.Namespace) -> int:
    import json

    from harness_trainer.jobs import launcher

    if args.action == "launch":
        train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
        cfg = launcher.JobLaunchConfig(
            train_args=train_args, flavor=args.flavor, image=args.image, secrets=args.secrets.split(",") if
            args.secrets else [], volumes=args.volume, timeout=args.timeout, push_to=args.push_to,
            install=args.install, namespace=args.namespace, name=args.name)
        spec = launcher.build_job(cfg)
        if args.dry_run:
            print(json.dumps(spec, indent=2))
            return 0
        job = launcher.submit(spec, namespace=args.namespace)
        print(f"submitted job {job.id} ({spec['flavor']}): {job.url}\n"
              f"follow it with: harness-train jobs logs {job.id} --follow")
    elif args.action == "status":
        job = launcher.status(args.job_id, args.namespace)
        print(f"{job.id}  {job.status.stage}  {job.flavor}  {job.url}" + (f"  ({job.status.message})"
                                                                          if job.status.message else ""))
    elif args.action == "logs":
        for line in launcher.logs(args.job_id, args.namespace, follow=args.follow):
            print(line)
    elif args.action == "cancel":
        launcher.cancel(args.job_id, args.namespace)
        print(f"cancelled job {args.job_id}")
    return 0


def _add_jobs_parser(sub) -> None:
    from harness_trainer.jobs.launcher import DEFAULT_IMAGE, DEFAULT_INSTALL

    jobs = sub.add_parser("jobs", help="run harness-train on Hugging Face Jobs (launch, status, logs, cancel)")
    actions = jobs.add_subparsers(dest="action", metavar="ACTION", required=True)
    launch = actions.add_parser(
        "launch", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="submit a training job: harness-train jobs launch [OPTIONS] -- [harness-train flags]")
    launch.add_argument("--flavor", default="h200x2", help="hardware: the engine takes GPU 0, the trainer the rest")
    launch.add_argument("--image", default=DEFAULT_IMAGE, help="Docker image of the job")
    launch.add_argument("--install", default=DEFAULT_INSTALL, help="pip requirement that installs this project")
    launch.add_argument("--secrets", default="HF_TOKEN", help="comma-separated names of local environment "
                        "variables sent as encrypted secrets (E2B_API_KEY is added for --sandbox e2b)")
    launch.add_argument("--volume", action="append", default=[], help="TYPE:SOURCE:/MOUNT, e.g. "
                        "bucket:me/runs:/data (repeatable)")
    launch.add_argument("--timeout", default="4h", help="maximum duration (s, m, h, d)")
    launch.add_argument("--push-to", default=None, help="Hub model repo that receives the final model and traces")
    launch.add_argument("--namespace", default=None, help="user or organisation to run under (default: yours)")
    launch.add_argument("--name", default=None, help="job name")
    launch.add_argument("--dry-run", action="store_true", help="print the job specification and exit")
    launch.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then the harness-train flags")
    for action, text in (("status", "a job's stage"), ("logs", "a job's logs"), ("cancel", "stop a job")):
        p = actions.add_parser(action, help=text)
        p.add_argument("job_id")
        p.add_argument("--namespace", default=None, help="user or organisation (default: yours)")
        if action == "logs":
            p.add_argument("--follow", action="store_true", help="stream until the job ends")
    jobs.set_defaults(func=_jobs)


def _proxy(proxy_args: list[str]) -> int:
    """The proxy runs in its own environment (mitmproxy's pins): hand over to that interpreter."""
    import os

    from harness_trainer.proxy.client import proxy_python

    python = proxy_python()
    os.execv(python, [python, "-m", "harness_trainer.proxy.server", *proxy_args])
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="harness-train",
        description="Reinforcement learning for coding agents you do not own. Training is the default command: "
                    "`harness-train --harness opencode --dataset DIR` is `harness-train train ...` "
                    "(`harness-train train --help` lists its flags).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = sub.add_parser("train", help="train the model behind an agent harness (the default command)",
                           description="Launch (or attach to) vLLM, start the capture proxy, run the agent on the "
                           "dataset's tasks in sandboxes and train with async GRPO. Outputs in --output-dir.")
    _add_train_flags(train)
    train.set_defaults(func=_train)

    model = sub.add_parser("model", help="build the embedded default model")
    model_sub = model.add_subparsers(dest="kind", metavar="KIND", required=True)
    tiny = model_sub.add_parser(
        "tiny", help="a tiny random Qwen2 with a locally trained tokenizer (cached by its parameters)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    tiny.add_argument("--out", default=None, help="directory to write (default: print the cached build's path)")
    tiny.add_argument("--layers", type=int, default=2, help="transformer layers")
    tiny.add_argument("--hidden", type=int, default=128, help="hidden size")
    tiny.add_argument("--heads", type=int, default=2, help="attention heads")
    tiny.add_argument("--kv-heads", type=int, default=1, help="key/value heads")
    tiny.add_argument("--intermediate", type=int, default=256, help="MLP width")
    tiny.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary size (before added tokens)")
    tiny.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    tiny.set_defaults(func=_model_tiny)

    serve = sub.add_parser("serve", help="run a vLLM server configured for capture and weight sync",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_argument("--model", required=True, help="Hugging Face model directory")
    serve.add_argument("--served-model-name", default="tiny", help="model id the server answers to")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind")
    serve.add_argument("--port", type=int, default=8000, help="port to bind")
    serve.add_argument("--max-model-len", type=int, default=32768, help="context length")
    serve.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for /health")
    serve.add_argument("--log", default=None, help="server log file (default: a temporary file)")
    serve.set_defaults(func=_serve)

    ev = sub.add_parser("eval", help="run an agent on a dataset's tasks and tabulate wins",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ev.add_argument("--harness", default="mini-swe-agent", help="mini-swe-agent, opencode, claude-code, codex or command")
    ev.add_argument("--agent-command", default=None, help="for --harness command: a CLI template with {instruction}")
    ev.add_argument("--agent-config", default=None,
                    help="mini-swe-agent: a YAML file layered over its default config, or 'compact' (short prompt)")
    ev.add_argument("--oracle-mistake-rate", type=float, default=0.0,
                    help="with --policy oracle: share of each task's attempts made with a plausible slip (redirection "
                         "forgotten, else first argument capitalised), exact per task (default: 0)")
    ev.add_argument("--dataset", default="builtin:toy-heldout",
                    help="folder of Harbor tasks, builtin:toy|toy-train|toy-heldout|bugfix|logs, hf:OWNER/NAME")
    ev.add_argument("--model", default=None, help="model folder to serve (default: the embedded tiny model)")
    ev.add_argument("--vllm-url", default=None, help="attach to a running vLLM instead of launching one")
    ev.add_argument("--policy", default="model", choices=["model", "oracle"],
                    help="who answers model calls: the model, or each task's known solution")
    ev.add_argument("-n", type=int, default=1, help="rollouts per task")
    ev.add_argument("--limit", type=int, default=None, help="only the first N tasks")
    ev.add_argument("--concurrency", type=int, default=4, help="rollouts at once")
    ev.add_argument("--sandbox", default="local",
                    help="local (bubblewrap), e2b, docker, or harbor[:ENV] (any Harbor environment type)")
    ev.add_argument("--agent-step-limit", type=int, default=12, help="agent steps per rollout")
    ev.add_argument("--agent-timeout", type=float, default=None, help="seconds per rollout (default: the task's)")
    ev.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    ev.add_argument("--max-tokens", type=int, default=512, help="cap on tokens per model call")
    ev.add_argument("--reward-key", default="reward", help="key of reward.json to read")
    ev.add_argument("--output-dir", default="runs/eval", help="where traces and rollout records go")
    ev.add_argument("--environment", default=None, help="white-box instead of an agent: module:Class (TRL's "
                    "environment_factory); --dataset is then a .jsonl of rows with a 'prompt' column")
    ev.add_argument("--reward-funcs", default=None, help="with --environment: comma-separated module:function "
                    "reward functions f(environments, **kwargs), summed")
    ev.add_argument("--max-tool-calling-iterations", type=int, default=None, help="with --environment: tool "
                    "rounds per episode (default: no bound)")
    ev.add_argument("--max-completion-length", type=int, default=1024, help="with --environment: tokens after "
                    "the prompt per episode, all turns together")
    ev.set_defaults(func=_eval)

    sft = sub.add_parser("sft", help="supervised warm-up on captured traces (TRL SFTTrainer, exact token ids)",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sft.add_argument("--traces", required=True, help="a traces.jsonl, or a folder holding traces.jsonl files "
                     "(e.g. the --output-dir of `harness-train eval --policy oracle`)")
    sft.add_argument("--model", default=None, help="starting model folder (default: the embedded tiny model)")
    sft.add_argument("--output-dir", default="runs/sft", help="where the run goes; the model lands in OUTPUT_DIR/final")
    sft.add_argument("--epochs", type=float, default=3.0, help="passes over the traces")
    sft.add_argument("--learning-rate", type=float, default=1e-3, help="peak learning rate (cosine schedule)")
    sft.add_argument("--batch-size", type=int, default=8, help="rows per optimizer step")
    sft.add_argument("--only-rewarded", action="store_true", help="keep only rollouts whose reward was >= 1")
    sft.add_argument("--seed", type=int, default=0, help="data order and initialisation seed")
    sft.add_argument("--use-peft", action="store_true", help="train a LoRA adapter; final/ is the merged model")
    sft.add_argument("--lora-rank", type=int, default=16, help="LoRA rank r")
    sft.add_argument("--lora-alpha", type=int, default=32, help="LoRA alpha (the update is scaled by alpha / r)")
    sft.add_argument("--lora-dropout", type=float, default=0.0, help="LoRA dropout")
    sft.add_argument("--lora-target-modules", default=None, help="comma-separated module names (default: the "
                                                                  "attention and MLP projections)")
    sft.set_defaults(func=_sft)

    view = sub.add_parser("view", help="browse a run: rollouts, turns, every token's mask, logprob and version",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                          description="Serve a local page over an output folder of `harness-train train`, `eval` or "
                                      "the proof, or write it as static files with --html.")
    view.add_argument("run_dir", help="the run's --output-dir (a proof's folder shows each of its stages)")
    view.add_argument("--port", type=int, default=8765, help="port to serve on (0: a free one)")
    view.add_argument("--host", default="127.0.0.1", help="address to bind")
    view.add_argument("--html", default=None, help="write the page and its data to this folder instead of serving")
    view.add_argument("--model", default=None, help="model folder whose tokenizer decodes the tokens (default: found "
                                                    "in the run folder)")
    view.set_defaults(func=_view)

    _add_jobs_parser(sub)

    # Listed for --help only: main() hands `proxy ...` to the proxy's own interpreter before parsing.
    sub.add_parser("proxy", add_help=False, help="run the capture proxy (`harness-train proxy --help` lists its flags)")
    return parser


COMMANDS = ("train", "model", "serve", "eval", "sft", "view", "jobs", "proxy")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["proxy"]:
        return _proxy(argv[1:])
    if argv and argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        argv = ["train", *argv]  # training is the default action: `harness-train --harness X --dataset Y`
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from harness_trainer.adapters.harnesses import AdapterError
    from harness_trainer.adapters.sandbox import SandboxError
    from harness_trainer.adapters.tasks import TaskError
    from harness_trainer.engine import EngineError
    from harness_trainer.environments import EnvironmentContractError
    from harness_trainer.jobs.launcher import JobError
    from harness_trainer.proxy.client import ProxyError
    from harness_trainer.rewards import RewardError
    from harness_trainer.sft import SFTError
    from harness_trainer.train import ConfigError
    from harness_trainer.trainer import TrainingStopped
    from harness_trainer.viewer.runs import ViewerError

    if threading.current_thread() is threading.main_thread():
        # Ctrl-C / SIGINT always interrupts cleanly: a shell starting us in the background from a script leaves
        # SIGINT ignored, and Python keeps an ignored SIGINT ignored (a run then went on training after kill -INT)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return args.func(args)
    except (EngineError, FileExistsError, FileNotFoundError, TaskError, SandboxError, AdapterError, ProxyError,
            SFTError, ConfigError, RewardError, TrainingStopped, JobError, ViewerError, EnvironmentContractError) as exc:
        print(f"harness-train: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
