"""commands: what a user runs. cli.py (`harness-train`, a thin shell over the Python API; the only module no
other imports), flags.py (every command's flags generated from its config dataclass), train.py (run_training),
evaluate.py, sft.py, models.py (`model tiny`, `model check`, `serve`), reference.py (docs/cli.md), proof.py (the
learning proof, `make demo`; proof_report.py its table), engine_demo.py (`make engine-demo`), jobs.py (Hugging
Face Jobs), viewer/ (`harness-train view`). Commands import the rest; nothing imports a command."""
