"""Echo, the seed's smallest environment, made local: its hosted Space is unreachable here, so the echo happens in
process, scored as OpenEnv's echo environment scores it (0.1 per character of the message echoed).

    harness-train --environment harness_trainer.examples.echo:EchoEnv \
        --reward-funcs harness_trainer.examples.echo:reward_func --dataset harness_trainer/examples/echo.jsonl

`get_reward` is public but, by TRL's rule, not a tool: the reward function reads it.
"""


def reward_func(completions, environments, **kwargs):
    return [environment.get_reward() for environment in environments]


class EchoEnv:
    def __init__(self):
        self._reward = None

    def reset(self, **kwargs) -> None:
        self._reward = None

    def step(self, message: str) -> str:
        """
        Send a message to the environment, which echoes it back.

        Args:
            message: What the environment should echo

        Returns:
            The message, echoed.
        """
        self._reward = 0.1 * len(message)
        return message

    def get_reward(self) -> float:
        """
        The reward of the last message echoed.

        Returns:
            0.1 per character of that message, or None before any.
        """
        return self._reward
