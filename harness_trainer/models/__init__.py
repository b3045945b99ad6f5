"""models: the embedded default model the project builds itself (tiny.py: a tiny Qwen2 with a locally trained
tokenizer and a hermes-style chat template, cached by its parameters). Imports no other package of this
project."""
