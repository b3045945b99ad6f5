"""The run viewer: `harness-train view RUN_DIR` (runs.py reads the folder, serve.py serves or exports the page)."""
