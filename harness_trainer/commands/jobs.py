"""`harness-train jobs`: the same training run on rented GPUs, through Hugging Face Jobs.

    harness-train jobs launch --flavor h200x2 --push-to me/agent-grpo -- --harness mini-swe-agent --sandbox e2b ...

One job, one host: the engine (vLLM) on GPU 0, the trainer on the other GPUs (`accelerate launch` when there
are several), the capture proxy next to them. Weights move engine-side through a RAM folder on the same host
(the `reload` sync), which is why the engine and the trainer must share the job. E2B sandboxes reach the proxy
through the job's public port. At the end the final model and the traces are pushed to `--push-to`.

Everything is checked before any network call: the train flags (parsed by the same parser as locally), the
flavor and its GPU count, the Hub token, and that every secret named is set in the local environment.
`--dry-run` prints the job specification with secret names only, never values.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
from dataclasses import dataclass, field

DEFAULT_IMAGE = "huggingface/trl"  # CUDA, torch and vLLM's dependencies preinstalled
DEFAULT_INSTALL = "harness-trainer"  # pip requirement for the project inside the job
ENGINE_PORT, PROXY_PORT = 8000, 8300
FLAVORS = ("cpu-basic", "cpu-upgrade", "cpu-performance", "cpu-xl", "t4-small", "t4-medium", "l4x1", "l4x4",
           "l40sx1", "l40sx4", "l40sx8", "a10g-small", "a10g-large", "a10g-largex2", "a10g-largex4", "a100-large",
           "a100x4", "a100x8", "h200", "h200x2", "h200x4", "h200x8", "rtx-pro-6000", "rtx-pro-6000x2",
           "rtx-pro-6000x4", "rtx-pro-6000x8")


class JobError(ValueError):
    """The job cannot be built or submitted; the message says what to change. Nothing was sent."""


@dataclass
class JobLaunchConfig:
    train_args: list[str]  # the harness-train flags, as they would be given locally
    flavor: str = "h200x2"
    image: str = DEFAULT_IMAGE
    secrets: list[str] = field(default_factory=lambda: ["HF_TOKEN"])  # names of local env variables
    volumes: list[str] = field(default_factory=list)  # TYPE:SOURCE:/mount, e.g. bucket:me/runs:/data
    timeout: str = "4h"
    push_to: str | None = None  # Hub model repo for the final model and traces
    install: str = DEFAULT_INSTALL
    namespace: str | None = None
    name: str | None = None


def gpu_count(flavor: str) -> int:
    if flavor not in FLAVORS:
        raise JobError(f"unknown flavor '{flavor}': choose one of {', '.join(FLAVORS)}")
    if flavor.startswith("cpu-"):
        return 0
    multi = re.search(r"x(\d+)$", flavor)
    return int(multi.group(1)) if multi else 1


def _train_config(train_args: list[str]):
    from harness_trainer.commands.train import ConfigError, parse_train_args

    if any(a in ("--vllm-url", "--engine-port") or a.startswith(("--vllm-url=", "--engine-port=")) for a in train_args):
        raise JobError("leave out --vllm-url/--engine-port: the job starts its own engine on GPU 0")
    if any(a == "--config" or a.startswith("--config=") for a in train_args):
        raise JobError("--config FILE is a local file the job cannot see: pass its options as flags after --")
    complaint = io.StringIO()
    try:
        with contextlib.redirect_stderr(complaint):
            return parse_train_args(train_args)
    except SystemExit:
        reason = complaint.getvalue().strip().splitlines()[-1:] or [""]
        raise JobError(f"the harness-train flags after -- are not valid ({reason[0]}): "
                       f"{shlex.join(train_args)}") from None
    except ConfigError as exc:
        raise JobError(str(exc)) from None


def _volume(spec: str):
    from huggingface_hub import Volume

    kind, _, rest = spec.partition(":")
    source, _, mount = rest.rpartition(":")
    if kind not in ("bucket", "model", "dataset", "space") or not source or not mount.startswith("/"):
        raise JobError(f"--volume {spec}: write TYPE:SOURCE:/MOUNT, TYPE one of bucket, model, dataset, space "
                       "(e.g. bucket:me/runs:/data)")
    return Volume(type=kind, source=source, mount_path=mount)


def job_script(cfg: JobLaunchConfig, train, gpus: int) -> str:
    """The job's shell program: install, engine on GPU 0, trainer on the rest, push."""
    out = train.output_dir
    model = shlex.quote(train.model) if train.model else "$(harness-train model tiny)"
    flags = [*cfg.train_args, "--vllm-url", f"http://127.0.0.1:{ENGINE_PORT}"]
    if train.sandbox == "e2b" and "--public-url" not in cfg.train_args:
        # E2B sandboxes run in the cloud: they reach the proxy through the job's public port.
        flags += ["--proxy-port", str(PROXY_PORT), "--public-url", f"https://${{JOB_ID}}--{PROXY_PORT}.hf.jobs"]
    trainer_gpus = ",".join(str(i) for i in range(1, gpus))
    launcher = (f"accelerate launch --num_processes {gpus - 1} -m harness_trainer.commands.cli train" if gpus > 2
                else "harness-train train")
    lines = [
        "set -euo pipefail",
        f"pip install --quiet {shlex.quote(cfg.install)}" + (" e2b" if train.sandbox == "e2b" else ""),
        f"MODEL={model}",
        f"CUDA_VISIBLE_DEVICES=0 harness-train serve --model \"$MODEL\" --port {ENGINE_PORT} --log engine.log &",
        f"until curl -sf http://127.0.0.1:{ENGINE_PORT}/health >/dev/null; do sleep 5; done",
        f"CUDA_VISIBLE_DEVICES={trainer_gpus} {launcher} {' '.join(_quote_keeping_env(f) for f in flags)}",
    ]
    if cfg.push_to:
        repo = shlex.quote(cfg.push_to)
        lines += [f"hf upload {repo} {shlex.quote(out + '/final')} . --repo-type model",
                  f"hf upload {repo} {shlex.quote(out + '/traces.jsonl')} traces.jsonl --repo-type model"]
    return "\n".join(lines)


def _quote_keeping_env(arg: str) -> str:
    """Shell-quote, but let ${JOB_ID} expand inside the job."""
    return f'"{arg}"' if "${JOB_ID}" in arg else shlex.quote(arg)


def build_job(cfg: JobLaunchConfig) -> dict:
    """The full job specification (what --dry-run prints and what is submitted), secret names only."""
    gpus = gpu_count(cfg.flavor)
    if gpus < 2:
        raise JobError(f"flavor {cfg.flavor} has {gpus} GPU(s): the engine takes GPU 0 and the trainer needs at "
                       "least one more on the same host (weights move through host memory); choose e.g. h200x2")
    train = _train_config(cfg.train_args)
    secrets = list(dict.fromkeys(cfg.secrets + (["E2B_API_KEY"] if train.sandbox == "e2b" else [])))
    if cfg.push_to and "HF_TOKEN" not in secrets:
        secrets.append("HF_TOKEN")  # the push needs write access inside the job
    for volume in cfg.volumes:
        _volume(volume)
    spec = {"image": cfg.image, "flavor": cfg.flavor, "timeout": cfg.timeout,
            "command": ["bash", "-c", job_script(cfg, train, gpus)],
            "env": {"PYTHONUNBUFFERED": "1", "VLLM_SERVER_DEV_MODE": "1"}, "secrets": secrets,
            "volumes": list(cfg.volumes), "expose_public": [PROXY_PORT] if train.sandbox == "e2b" else [],
            "labels": {"app": "harness-train", "harness": train.harness}}
    if cfg.name:
        spec["name"] = cfg.name
    return spec


def hub_token() -> str:
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise JobError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (a token with the jobs "
                       "permission); nothing was sent")
    return token


def submit(spec: dict, namespace: str | None = None):
    """Submit through huggingface_hub's Jobs API; secret values are read from the local environment here."""
    from huggingface_hub import HfApi

    token = hub_token()
    missing = [name for name in spec["secrets"] if not os.environ.get(name)]
    if missing:
        raise JobError(f"secret(s) {', '.join(missing)} not set in this environment: export them (their values "
                       "are sent encrypted, never printed) or leave them out with --secrets; nothing was sent")
    api = HfApi(token=token)
    return api.run_job(image=spec["image"], command=spec["command"], env=spec["env"],
                       secrets={name: os.environ[name] for name in spec["secrets"]}, flavor=spec["flavor"],
                       timeout=spec["timeout"], volumes=[_volume(v) for v in spec["volumes"]] or None,
                       expose_public=spec["expose_public"] or None, labels=spec["labels"], name=spec.get("name"),
                       namespace=namespace)


def status(job_id: str, namespace: str | None = None):
    from huggingface_hub import HfApi

    return HfApi(token=hub_token()).inspect_job(job_id=job_id, namespace=namespace)


def logs(job_id: str, namespace: str | None = None, follow: bool = False):
    from huggingface_hub import HfApi

    return HfApi(token=hub_token()).fetch_job_logs(job_id=job_id, namespace=namespace, follow=follow)


def cancel(job_id: str, namespace: str | None = None) -> None:
    from huggingface_hub import HfApi

    HfApi(token=hub_token()).cancel_job(job_id=job_id, namespace=namespace)
