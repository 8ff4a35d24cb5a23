"""A fixed small vocabulary shared by the generated texts and the locally trained tokenizer."""

from __future__ import annotations

import random

WORDS: list[str] = (
    "the a an of to in on for with and or but is are was were be been this that these those "
    "model data train loss step batch token gpu node rank shard layer weight grad update "
    "invoice total amount date vendor customer number due tax item price quantity currency "
    "what how why when where which who please explain describe list give summarize compute "
    "red green blue small large fast slow new old good bad first last next previous "
    "one two three four five six seven eight nine ten hundred thousand "
    "apple river mountain city music book paper window garden ocean forest cloud "
    "answer question result value name field extract json yes no"
).split()

DIGITS: list[str] = [str(d) for d in range(10)]


def sentence(rng: random.Random, min_words: int = 4, max_words: int = 12) -> str:
    """Return a random sentence made of :data:`WORDS`."""
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))
