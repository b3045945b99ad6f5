"""Where a model comes from: a local folder, or a Hugging Face Hub id resolved once into the Hub cache.

    resolve_model("runs/sft/final")            -> that folder, checked (config.json)
    resolve_model("Qwen/Qwen3-8B", "a1b2c3d")  -> ~/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/...

Every command that names a model (train, eval, serve, sft, view, jobs) goes through here, so a Hub id works
the same everywhere. huggingface_hub does the work: its cache (a second run downloads nothing), HF_TOKEN for
gated and private repos, HF_ENDPOINT for a mirror, HF_HUB_OFFLINE=1 to use only what is cached. Only the files
a causal LM needs are fetched: config, weights, tokenizer and chat template, not a repo's other formats.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from harness_trainer._exceptions import ModelError

# A model repo often also holds GGUF, ONNX, original/ PyTorch checkpoints and so on; these are what vLLM,
# transformers and the tokenizer read.
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]


@dataclass(frozen=True)
class ModelRef:
    """A resolved model: the folder to load, and the id it is served and reported as."""
    path: Path
    name: str  # the Hub id, or the folder's name ("tiny" for the embedded default)
    revision: str | None = None  # the commit the Hub resolved to (None for a local folder)


def is_hub_id(name: str) -> bool:
    """OWNER/NAME that is not a path here: what the Hub calls a repo id."""
    if Path(name).expanduser().exists() or name.startswith(("/", ".", "~")):
        return False
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.endswith((".json", ".safetensors"))


def check_model_dir(path: Path, named: str | None = None) -> Path:
    named = named or str(path)
    if not path.is_dir():
        raise ModelError(
            f"model folder {named} does not exist. Give a Hugging Face model folder (config.json, weights, tokenizer), "
            "a Hub id OWNER/NAME, or build the embedded default with `harness-train model tiny --output-dir DIR`.")
    if not (path / "config.json").is_file():
        raise ModelError(
            f"model {named}: {path} has no config.json, so it is not a Hugging Face model folder. Point --model at "
            "the folder that holds config.json, the *.safetensors weights and the tokenizer files.")
    return path


def served_name(path: Path) -> str:
    """The id a local folder is served as: "tiny" for the embedded default, else the folder's name."""
    marker = path / "harness_model.json"
    if marker.is_file() and json.loads(marker.read_text()).get("kind") == "tiny":
        return "tiny"
    return path.resolve().name


def resolve_model(name: str | Path, revision: str | None = None) -> ModelRef:
    """The folder for `name` (a local folder or a Hub id at `revision`), with a clear ModelError otherwise."""
    name = str(name)
    if not is_hub_id(name):
        if revision:
            raise ModelError(f"--model-revision {revision} is for a Hub id; {name} is a local folder")
        path = check_model_dir(Path(name).expanduser(), name)
        return ModelRef(path, served_name(path))
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision}" if revision else ""
    try:
        folder = Path(snapshot_download(name, revision=revision, allow_patterns=MODEL_FILES))
    except GatedRepoError:
        raise ModelError(f"--model {name}: the repo is gated. Accept its terms on https://huggingface.co/{name}, "
                         "then set HF_TOKEN to a token of that account (or run `hf auth login`)") from None
    except RevisionNotFoundError:
        raise ModelError(f"--model {name}: no revision {revision} in that repo; give a branch, tag or commit "
                         "that exists (or leave out --model-revision for main)") from None
    except RepositoryNotFoundError:
        raise ModelError(f"--model {name}: no such model repo on the Hub, or it is private and HF_TOKEN does not "
                         "grant access. Check the id (OWNER/NAME) and the token; a local folder also works") from None
    except LocalEntryNotFoundError:
        raise ModelError(f"--model {name}{at}: the Hub cannot be reached (offline, or HF_HUB_OFFLINE=1) and the "
                         "model is not in the local Hub cache. Download it once where the Hub is reachable "
                         f"(`hf download {name}`), or give a local model folder") from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        raise ModelError(f"--model {name}{at}: the Hub answered HTTP {status} ({str(exc).splitlines()[0]}). "
                         "Check HF_TOKEN and the id, or give a local model folder") from None
    except OSError as exc:  # network failures that huggingface_hub does not wrap
        raise ModelError(f"--model {name}{at}: could not download it ({exc}). Check the network and "
                         "HF_ENDPOINT, or give a local model folder") from None
    check_model_dir(folder, name)
    return ModelRef(folder, name, folder.name)


def model_or_default(name: str | None, revision: str | None = None) -> ModelRef:
    """resolve_model(name), or the embedded tiny model when no model is named."""
    if name:
        return resolve_model(name, revision)
    from harness_trainer.models.tiny import ensure_tiny_model

    return ModelRef(ensure_tiny_model(), "tiny")


def cached_file(name: str, filename: str) -> Path | None:
    """`filename` of a model named by folder or Hub id, from the folder or the Hub cache; no download."""
    if not is_hub_id(name):
        path = Path(name).expanduser() / filename
        return path if path.is_file() else None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(name, filename)
    return Path(found) if isinstance(found, str) else None
