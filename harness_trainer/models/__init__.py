"""models: resolving and building models. hub.py (a folder or Hub id, checked, downloaded once), formats.py (what
a model folder holds: weights, chat template, tied embeddings), untie.py (the untied serving copy of a tied model),
tiny.py (the embedded default: a tiny Qwen2 / Qwen3 / Llama with a locally trained tokenizer and a hermes-style
chat template, cached by its parameters). Imports no other package of this project."""
