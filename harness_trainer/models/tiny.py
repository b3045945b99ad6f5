"""The embedded default model: a tiny causal LM with random weights and a locally trained tokenizer.

No model hub is reachable where this project is tested, so it builds its own model, deterministically:
  1. a byte-level BPE trained on Python source from the standard library of the running interpreter,
     with Qwen2's exact normaliser and pre-tokeniser (transformers re-imposes them for `model_type: qwen2`;
     any other choice makes AutoTokenizer, tokenizer.json and vLLM disagree on ids);
  2. the family's markers as added NON-special tokens, so they survive `skip_special_tokens` and vLLM's
     tool and reasoning parsers see them;
  3. the family's chat template (beside this file): `qwen2` Hermes tool calls; `qwen3` the same with
     <think> reasoning, dropped from the history before the last user query as Qwen3's template does;
     `llama` Llama 3.1 headers and bare-JSON calls;
  4. the architecture's config, embeddings untied unless `tie_embeddings` (the shape of Qwen2.5-0.5B,
     Qwen3-0.6B..4B and Llama 3.2 1B/3B: the weight sync must then update lm_head with the embedding).
Builds are cached by their parameters, so tests and demos build once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
from pathlib import Path

from harness_trainer.choices import choose

BUILDER_VERSION = 1  # bump when the build changes in a way the parameters do not capture

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKER_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
# Llama 3's turn framing; <|python_tag|> is the marker vLLM's llama3_json parser looks up in the vocabulary
LLAMA_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA_MARKERS = ["<|python_tag|>"]
ARCHS = ("qwen2", "qwen3", "llama")
# Qwen2's pre-tokenisation split: contractions, letter runs, single digits, punctuation runs, newlines, spaces.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS_BYTES = 8_000_000
CHAT_TEMPLATE = Path(__file__).with_name("chat_template.jinja")
LLAMA_TEMPLATE = Path(__file__).with_name("chat_template_llama.jinja")


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    arch: str = "qwen2"  # one of ARCHS
    tie_embeddings: bool = False
    layers: int = 2
    hidden: int = 128
    heads: int = 2
    kv_heads: int = 1
    intermediate: int = 256
    vocab: int = 4096  # BPE vocabulary before added tokens and padding
    max_positions: int = 32768
    seed: int = 0

    def __post_init__(self):
        choose("tiny architecture", self.arch, ARCHS)

    def key(self) -> str:
        template = hashlib.sha256(chat_template(self.arch).encode()).hexdigest()  # a template edit is a new model
        payload = json.dumps({"builder": BUILDER_VERSION, "template": template, **dataclasses.asdict(self)},
                             sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def folder_name(self) -> str:
        if self.arch == "qwen2" and not self.tie_embeddings:
            return f"tiny-{self.key()}"
        return f"tiny-{self.arch}{'-tied' if self.tie_embeddings else ''}-{self.key()}"


def chat_template(arch: str) -> str:
    if arch == "llama":
        return LLAMA_TEMPLATE.read_text()
    hermes = CHAT_TEMPLATE.read_text()
    return "{%- set reasoning = true -%}\n" + hermes if arch == "qwen3" else hermes


def cache_root() -> Path:
    return Path(os.environ.get("HARNESS_TRAINER_CACHE", Path.home() / ".cache" / "harness-trainer"))


def corpus_files() -> list[Path]:
    """Standard-library Python sources in a fixed order, up to CORPUS_BYTES."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    picked, total = [], 0
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib).parts
        if rel[0] in {"site-packages", "test", "idlelib", "lib2to3"} or not path.is_file():
            continue
        picked.append(path)
        total += path.stat().st_size
        if total >= CORPUS_BYTES:
            break
    if total < 1_000_000:
        raise RuntimeError(f"only {total} bytes of Python source found under {stdlib}: cannot train a tokenizer")
    return picked


def train_tokenizer(vocab: int, arch: str = "qwen2"):
    """A byte-level BPE with Qwen2's pre-tokenisation, trained on the stdlib corpus."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # single-threaded training is deterministic
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    special, markers = (LLAMA_SPECIAL, LLAMA_MARKERS) if arch == "llama" else (SPECIAL_TOKENS, MARKER_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def lines():
        for path in corpus_files():
            yield path.read_text(encoding="utf-8", errors="replace")

    tok.train_from_iterator(lines(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in markers])
    return tok


def build(spec: TinyModelSpec, out: Path) -> Path:
    """Build the model into `out` (which must not exist yet)."""
    import torch
    import transformers
    from transformers import PreTrainedTokenizerFast

    tok = train_tokenizer(spec.vocab, spec.arch)
    # (begin-of-text, end-of-turn, end-of-text) of the family
    bos, eos, eot = (("<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>") if spec.arch == "llama" else
                     ("<|endoftext|>", "<|im_end|>", "<|endoftext|>"))
    ids = {t: tok.token_to_id(t) for t in (bos, eos, eot)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        pad_token=eot,
        eos_token=eos,
        unk_token=None,
        model_max_length=spec.max_positions,
        add_bos_token=False,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    tokenizer.chat_template = chat_template(spec.arch)

    padded_vocab = -(-tok.get_vocab_size() // 64) * 64
    config_cls, model_cls = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
                             "llama": ("LlamaConfig", "LlamaForCausalLM")}[spec.arch]
    extra = {"head_dim": spec.hidden // spec.heads} if spec.arch == "qwen3" else {}
    config = getattr(transformers, config_cls)(
        vocab_size=padded_vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions,
        rope_theta=1_000_000.0,
        tie_word_embeddings=spec.tie_embeddings,
        bos_token_id=ids[bos],
        eos_token_id=ids[eos],
        pad_token_id=ids[eot],
        torch_dtype="float32",
        **extra,
    )
    torch.manual_seed(spec.seed)
    model = getattr(transformers, model_cls)(config).to(torch.float32)
    model.generation_config.eos_token_id = [ids[eos], ids[eot]]
    model.generation_config.pad_token_id = ids[eot]

    out.mkdir(parents=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "harness_model.json").write_text(json.dumps({
        "kind": "tiny", "builder": BUILDER_VERSION, "spec": dataclasses.asdict(spec),
        "parameters": sum(p.numel() for p in model.parameters()),
    }, indent=2) + "\n")
    return out


def ensure_tiny_model(spec: TinyModelSpec | None = None, out: Path | None = None) -> Path:
    """Return a directory holding the model for `spec`, building it once into the cache.

    With `out`, the cached build is copied there (an existing build of the same spec is reused)."""
    spec = spec or TinyModelSpec()
    cached = cache_root() / "models" / spec.folder_name()
    if not (cached / "harness_model.json").exists():
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=cached.name + ".", dir=cached.parent))
        try:
            build(spec, staging / "model")
            try:
                (staging / "model").rename(cached)  # atomic: a concurrent builder may win, both are equal
            except OSError:
                if not (cached / "harness_model.json").exists():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    if out is None:
        return cached
    out = Path(out)
    marker = out / "harness_model.json"
    if marker.exists() and json.loads(marker.read_text()).get("spec") == dataclasses.asdict(spec):
        return out
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and holds something else; choose an empty or new --output-dir directory")
    shutil.copytree(cached, out, dirs_exist_ok=True)
    return out
