"""Jobs: launch a harness-train run on Hugging Face Jobs (issue 7)."""
