"""harness-trainer: reinforcement learning for coding agents you do not own.

Data flows one way: agent -> proxy -> trace -> rows -> loss -> weights -> vLLM.
"""

__version__ = "0.1.0"
