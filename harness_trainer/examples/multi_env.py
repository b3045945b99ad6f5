"""The seed's multi-environment router: one environment_factory class over Echo and Wordle, the row's `env`
column choosing the game at reset(); each reward function scores its own game's rows and returns None for the
other's (summed with None skipped: TRL's nan-sum).

    harness-train --environment harness_trainer.examples.multi_env:MultiEnv \
        --reward-funcs harness_trainer.examples.multi_env:wordle_reward,harness_trainer.examples.multi_env:echo_reward \
        --dataset harness_trainer/examples/multi_env.jsonl
"""

from harness_trainer.examples.echo import EchoEnv
from harness_trainer.examples.wordle import Wordle


class MultiEnv:
    def __init__(self):
        self.active = None
        self._echo, self._wordle = EchoEnv(), Wordle()

    def reset(self, **kwargs) -> str | None:
        self.active = kwargs.get("env", "wordle")
        if self.active == "wordle":
            return self._wordle.reset(**kwargs)
        if self.active == "echo":
            return self._echo.reset(**kwargs)
        raise ValueError(f"Unknown environment: {self.active}")

    def guess(self, guess: str) -> str:
        """
        Make a guess in the Wordle game.

        Args:
            guess: The guessed word, formatted as '[abcde]'

        Returns:
            The feedback for this guess.
        """
        if self.active != "wordle":
            raise ValueError("guess is only available in Wordle")
        return self._wordle.guess(guess)

    def echo(self, message: str) -> str:
        """
        Send a message to the echo environment, which echoes it back.

        Args:
            message: What the environment should echo

        Returns:
            The message, echoed.
        """
        if self.active != "echo":
            raise ValueError("echo is only available in Echo")
        return self._echo.step(message)


def wordle_reward(environments, **kwargs) -> list[float | None]:
    return [(1.0 if env._wordle.won else 0.0) if env.active == "wordle" else None for env in environments]


def echo_reward(environments, **kwargs) -> list[float | None]:
    return [(env._echo.get_reward() or 0.0) if env.active == "echo" else None for env in environments]
