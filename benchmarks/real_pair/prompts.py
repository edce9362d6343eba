"""Instruction-style prompts with short answers, generated offline and deterministically.

Twelve task templates (facts, word tasks, arithmetic, one-sentence writing, summarising a short
story, sentiment, tense rewriting) filled from small word lists; every filled prompt is distinct.
`generate_prompts(n, seed)` shuffles the full product with `random.Random(seed)` and returns the
first `n`: the same call gives the same list on any machine (no hash order, no global RNG).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

COUNTRIES = (
    "France", "Germany", "Italy", "Spain", "Japan", "Canada", "Brazil", "Egypt", "India", "China",
    "Mexico", "Russia", "Kenya", "Norway", "Greece", "Peru", "Australia", "Argentina", "Portugal", "Sweden",
)  # fmt: skip
WORDS = (
    "happy", "big", "fast", "cold", "early", "strong", "bright", "quiet", "rich", "young",
    "heavy", "soft", "easy", "clean", "full", "wide", "high", "wet", "loud", "kind",
)  # fmt: skip
CATEGORIES = (
    "fruits", "animals", "colors", "vegetables", "sports", "musical instruments", "planets", "birds",
    "flowers", "tools", "jobs", "drinks",
)  # fmt: skip
TOPICS = (
    "the ocean", "a cat", "winter", "coffee", "the moon", "a library", "rain", "a bicycle", "music", "a forest",
    "the sun", "a river", "bread", "a train", "friendship", "a garden", "the city", "snow", "a dog", "the stars",
)  # fmt: skip
LANGUAGES = ("French", "Spanish", "German")
TRANSLATE = ("hello", "thank you", "water", "house", "cat", "book", "friend", "apple", "good morning", "dog")
NAMES = ("Anna", "Tom", "Maria", "Sam", "Lena", "Omar", "Kate", "Ben")
PLACES = (("market", "apples"), ("bakery", "bread"), ("library", "a book"), ("shop", "shoes"), ("station", "a ticket"))
WEATHER = (("rainy", "an umbrella"), ("sunny", "a hat"), ("cold", "a warm coat"), ("windy", "a scarf"))
PRODUCTS = ("phone", "movie", "pizza", "hotel", "book", "laptop", "concert", "chair")
GOOD = ("great", "excellent", "wonderful", "comfortable")
BAD = ("terrible", "awful", "broken", "boring")
VERBS = (
    ("eats", "apple"),
    ("reads", "book"),
    ("opens", "door"),
    ("paints", "wall"),
    ("washes", "car"),
    ("cooks", "soup"),
)
THINGS = ("grass", "the sky", "snow", "a banana", "a tomato", "coal", "an orange", "milk")


def _templates() -> Iterator[str]:
    """Every filled prompt of every template, in a fixed order."""
    for country in COUNTRIES:
        yield f"What is the capital of {country}? Answer in one sentence."
    for word in WORDS:
        yield f"What is the opposite of the word '{word}'? Answer with one word."
        yield f"Give one synonym of the word '{word}'."
    for a, b in itertools.product(range(2, 20, 3), range(3, 30, 4)):
        yield f"What is {a} plus {b}? Answer with the number."
    for category, count in itertools.product(CATEGORIES, ("two", "three")):
        yield f"Name {count} {category}. Answer with a short list."
    for topic in TOPICS:
        yield f"Write one short sentence about {topic}."
        yield f"Describe {topic} in five words."
    for word, language in itertools.product(TRANSLATE, LANGUAGES):
        yield f"Translate '{word}' into {language}. Answer with the translation only."
    for name, (place, item), (weather, gear) in itertools.product(NAMES, PLACES, WEATHER):
        pronoun = "she" if name in ("Anna", "Maria", "Lena", "Kate") else "he"
        story = (
            f"{name} went to the {place} on Monday to buy {item}. It was {weather} outside, so {pronoun} "
            f"took {gear}. At the {place}, {pronoun} met an old friend and they talked for an hour."
        )
        yield f"Summarize in one sentence: {story}"
    for product, good, bad in itertools.product(PRODUCTS, GOOD, BAD):
        yield f"Is this review positive or negative? 'The {product} was {good}.' Answer with one word."
        yield f"Is this review positive or negative? 'The {product} was {bad}.' Answer with one word."
    for name, (verb, obj) in itertools.product(NAMES, VERBS):
        yield f"Rewrite in the past tense: '{name} {verb} the {obj}.'"
    for thing in THINGS:
        yield f"What color is {thing}? Answer in one sentence."


def all_prompts() -> list[str]:
    """The distinct filled prompts, in template order."""
    return list(dict.fromkeys(_templates()))


def generate_prompts(n: int, seed: int) -> list[str]:
    """`n` distinct prompts, a deterministic shuffle of all of them by `seed`."""
    prompts = all_prompts()
    if n > len(prompts):
        raise ValueError(f"asked for {n} prompts; the templates make {len(prompts)}")
    random.Random(seed).shuffle(prompts)
    return prompts[:n]
