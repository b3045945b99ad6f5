"""Wordle as the seed plays it: a `guess` tool, TextArena's feedback format (the guess's letters, then G / Y / X
under each), six guesses, and three reward terms logged apart: reward_win, reward_partial, reward_invalid.

TextArena's own Wordle downloads NLTK word lists when imported, which cannot happen offline, so this is a local
game with the same rules and messages. Any five letters count as a word (no dictionary here); the secret comes
from the row's `secret` column, else from the row's `seed` over a short list.

    harness-train --environment harness_trainer.examples.wordle:Wordle \
        --reward-funcs harness_trainer.examples.wordle:reward_win,harness_trainer.examples.wordle:reward_partial,\
harness_trainer.examples.wordle:reward_invalid --dataset harness_trainer/examples/wordle.jsonl
"""

import random
import re

WORDS = ["crane", "slate", "pride", "ghost", "flame", "brick", "plant", "sword", "mouse", "tiger",
         "lemon", "cloud", "river", "stone", "chair", "bread", "light", "water", "sugar", "train"]
PROMPT = """You are playing Wordle. A secret 5-letter English word has been chosen; you have 6 guesses.
Use the tool `guess` with your word in square brackets, e.g. [crane]. After each guess you get feedback under
each letter: G = right letter, right place; Y = in the word, elsewhere; X = not in the word."""


def score(guess: str, secret: str) -> list[str]:
    """G / Y / X per letter, a repeated letter counted only as often as the secret has it."""
    marks, left = ["X"] * len(guess), list(secret)
    for i, (g, s) in enumerate(zip(guess, secret)):
        if g == s:
            marks[i], left[i] = "G", None
    for i, g in enumerate(guess):
        if marks[i] == "X" and g in left:
            marks[i] = "Y"
            left[left.index(g)] = None
    return marks


class Wordle:
    def __init__(self):
        self.secret, self.guesses, self.invalid, self.done, self.won = "", [], 0, False, False

    def reset(self, **kwargs) -> str | None:
        self.secret = kwargs.get("secret") or random.Random(kwargs.get("seed")).choice(WORDS)
        self.guesses, self.invalid, self.done, self.won = [], 0, False, False
        return None

    def guess(self, guess: str) -> str:
        """
        Make a guess in the Wordle game.

        Args:
            guess: The guessed word, formatted as '[abcde]'

        Returns:
            The feedback for this guess.
        """
        if self.done:
            raise ValueError("Game over.")
        found = re.search(r"\[(\w+)\]", guess)
        word = found.group(1).lower() if found else ""
        if not found:
            problem = "You tried submitting a word in the wrong format. Please make sure to use squared brackets."
        elif len(word) != 5 or not word.isalpha():
            problem = "Your word must be exactly 5 letters."
        elif word in [g for g, _ in self.guesses]:
            problem = f"You have already guessed '{word}' before. Please try a different word."
        else:
            problem = ""
        if problem:
            self.invalid += 1
            return f"You attempted an invalid move. Reason: {problem}"
        marks = score(word, self.secret)
        self.guesses.append((word, marks))
        if word == self.secret:
            self.done = self.won = True
            return "Congratulations! You guessed the word correctly!"
        left = 6 - len(self.guesses)
        feedback = f"You submitted [{word}].\nFeedback:\n{' '.join(word.upper())}\n{' '.join(marks)}\n"
        if left == 0:
            self.done = True
            return feedback + f"The turn limit has been reached. The secret word was: {self.secret}."
        return feedback + f"You have {left} guesses left."


def reward_win(environments, **kwargs) -> list[float]:
    """1 for a solved game."""
    return [1.0 if env.won else 0.0 for env in environments]


def reward_partial(environments, **kwargs) -> list[float]:
    """How close the last guess came: greens, and yellows at half, over the five letters."""
    rewards = []
    for env in environments:
        marks = env.guesses[-1][1] if env.guesses else []
        rewards.append((marks.count("G") + 0.5 * marks.count("Y")) / 5)
    return rewards


def reward_invalid(environments, **kwargs) -> list[float]:
    """Minus the share of guesses that were invalid (format, length, repeats)."""
    return [-env.invalid / (env.invalid + len(env.guesses)) if env.invalid else 0.0 for env in environments]
