"""The seed's white-box environments, shipped to run unchanged: echo.py, wordle.py and multi_env.py (a router over
the two by the row's `env` column), each with its reward functions and a rows file (*.jsonl) beside it."""
