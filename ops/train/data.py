"""The default model's synthetic instruction set: conversations of eleven families, rendered through
the model's chat template with thinking on and off, with a held-out split whose numbers, strings,
names and pictures never occur in training.

Families: add, sub (numbers 0..60), facts (a fixed table), copy, reverse and count (short strings
of spaced letters), followup (two-turn arithmetic and capitals), tool (a Qwen3-coder XML tool
call for a city of a fixed list), and the image families colour, shape, count_shapes, position,
text.
Each `Example` is a chat `messages` list (OpenAI form, images as `{"type": "image"}` parts), its
`tools`, the expected answer (what `message.content` must equal) and a short reasoning text used
when thinking is on. Used by ops/train/train_default.py and ops/train/evaluate.py.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field

import numpy as np

from ops.train import images

TEXT_FAMILIES = ("add", "sub", "facts", "copy", "reverse", "count", "followup", "tool")
IMAGE_FAMILIES = ("colour", "shape", "count_shapes", "position", "text")
FAMILIES = TEXT_FAMILIES + IMAGE_FAMILIES

CAPITALS = {
    "France": "Paris", "Spain": "Madrid", "Italy": "Rome", "Germany": "Berlin",
    "Japan": "Tokyo", "Egypt": "Cairo", "Canada": "Ottawa", "Norway": "Oslo",
    "Sweden": "Stockholm", "Poland": "Warsaw", "Greece": "Athens", "Peru": "Lima",
    "Kenya": "Nairobi", "Chile": "Santiago", "Portugal": "Lisbon", "Austria": "Vienna",
    "Ireland": "Dublin", "Cuba": "Havana", "Russia": "Moscow", "China": "Beijing",
}  # fmt: skip
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = (
    "January February March April May June July August September October November December".split()
)
UNITS = {
    "How many centimetres are in a metre?": "100",
    "How many metres are in a kilometre?": "1000",
    "How many grams are in a kilogram?": "1000",
    "How many minutes are in an hour?": "60",
    "How many seconds are in a minute?": "60",
    "How many hours are in a day?": "24",
    "How many days are in a week?": "7",
    "How many months are in a year?": "12",
    "How many millimetres are in a centimetre?": "10",
}
LETTERS = "abcdefghijklmnopqrstuvwxyz"
TOOL_CITIES = sorted(
    set(CAPITALS.values())
    | set("London Boston Denver Sydney Mumbai Seoul Dubai Zurich Prague Munich".split())
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city name."}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Get the local time in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city name."}},
                "required": ["city"],
            },
        },
    },
]
MAX_NUMBER = 60


def held_out(key: str) -> bool:
    """The held-out side of the split: about one key in nine, fixed by the key's text."""
    return zlib.crc32(key.encode()) % 9 == 0


@dataclass
class Example:
    family: str
    messages: list[dict]
    answer: str  # the expected message.content (for tool calls: the call's XML text)
    reasoning: str  # short thinking text
    tools: list[dict] | None = None
    pixels: list[np.ndarray] = field(default_factory=list)  # one [128, 128, 3] uint8 per image
    tool_call: tuple[str, dict] | None = None  # (name, arguments) expected through the API

    def completion(self, thinking: bool) -> str:
        """The assistant text after the generation prompt, up to (not including) <|im_end|>."""
        return f"{self.reasoning}\n</think>\n\n{self.answer}" if thinking else self.answer


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _image_user(text: str) -> dict:
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}


def _spaced(rng: random.Random, low: int, high: int, alphabet: str = LETTERS) -> str:
    return " ".join(rng.choice(alphabet) for _ in range(rng.randint(low, high)))


class Generator:
    """Draws examples of one split ("train" or "heldout") from `seed`."""

    def __init__(self, split: str, seed: int) -> None:
        if split not in ("train", "heldout"):
            raise ValueError(f"split: expected train or heldout, got {split!r}")
        self.heldout = split == "heldout"
        self.rng = random.Random(f"{split}-{seed}")

    def _keep(self, key: str) -> bool:
        return held_out(key) == self.heldout

    def _draw(self, make, key_of):
        for _ in range(10_000):
            value = make()
            if self._keep(key_of(value)):
                return value
        raise RuntimeError("no value on this side of the split")

    def _pair(self, op: str) -> tuple[int, int]:
        def make():
            a, b = self.rng.randint(0, MAX_NUMBER), self.rng.randint(0, MAX_NUMBER)
            return (max(a, b), min(a, b)) if op == "-" else (a, b)

        return self._draw(make, lambda p: f"{p[0]}{op}{p[1]}")

    def _string(self, family: str, low: int = 3, high: int = 6) -> str:
        return self._draw(lambda: _spaced(self.rng, low, high), lambda s: s)

    # ------------------------------------------------------------------ text families
    def add(self) -> Example:
        a, b = self._pair("+")
        q = self.rng.choice(["What is {a} + {b}?", "Compute {a} + {b}.", "{a} + {b} = ?"])
        return Example("add", [_user(q.format(a=a, b=b))], str(a + b), f"{a} + {b} = {a + b}")

    def sub(self) -> Example:
        a, b = self._pair("-")
        q = self.rng.choice(["What is {a} - {b}?", "Compute {a} - {b}.", "{a} - {b} = ?"])
        return Example("sub", [_user(q.format(a=a, b=b))], str(a - b), f"{a} - {b} = {a - b}")

    def facts(self) -> Example:
        kind = self.rng.randrange(4)
        if kind == 0:
            country = self.rng.choice(sorted(CAPITALS))
            q = self.rng.choice(["What is the capital of {c}?", "Name the capital of {c}."])
            city = CAPITALS[country]
            return Example(
                "facts", [_user(q.format(c=country))], city, f"The capital of {country} is {city}."
            )
        if kind == 1:
            q = self.rng.choice(sorted(UNITS))
            return Example("facts", [_user(q)], UNITS[q], f"The answer is {UNITS[q]}.")
        names, what = (DAYS, "day") if kind == 2 else (MONTHS, "month")
        i = self.rng.randrange(len(names))
        after = self.rng.random() < 0.5
        j = (i + (1 if after else -1)) % len(names)
        q = f"What {what} comes {'after' if after else 'before'} {names[i]}?"
        return Example("facts", [_user(q)], names[j], f"{names[i]}, then {names[j]}.")

    def copy(self) -> Example:
        s = self._string("copy")
        return Example("copy", [_user(f"Repeat these letters: {s}")], s, "I repeat the letters.")

    def reverse(self) -> Example:
        s = self._string("reverse")
        rev = " ".join(reversed(s.split()))
        return Example(
            "reverse", [_user(f"Reverse these letters: {s}")], rev, "I reverse the letters."
        )

    def count(self) -> Example:
        """The letter occurs 0-3 times, uniformly (drawn from the string itself, almost every
        answer was 1 and the first H200 builds always answered 1)."""

        def make():
            n = self.rng.randint(0, 3)
            letter = self.rng.choice(LETTERS)
            others = LETTERS.replace(letter, "")
            chars = [self.rng.choice(others) for _ in range(self.rng.randint(max(3, n + 1), 8) - n)]
            for _ in range(n):
                chars.insert(self.rng.randint(0, len(chars)), letter)
            return " ".join(chars), letter, n

        s, letter, n = self._draw(make, lambda v: f"{v[1]}:{v[0]}")
        q = f"How many times does the letter {letter} appear in: {s}?"
        return Example("count", [_user(q)], str(n), f"I count the letter {letter}: {n}.")

    def followup(self) -> Example:
        if self.rng.random() < 0.5:
            a, b = self._pair("+")
            c = self.rng.randint(1, 9)
            messages = [
                _user(f"What is {a} + {b}?"),
                {"role": "assistant", "content": str(a + b)},
                _user(f"Now add {c}."),
            ]
            total = a + b + c
            return Example("followup", messages, str(total), f"{a + b} + {c} = {total}")
        first, second = self.rng.sample(sorted(CAPITALS), 2)
        messages = [
            _user(f"What is the capital of {first}?"),
            {"role": "assistant", "content": CAPITALS[first]},
            _user(f"And of {second}?"),
        ]
        city = CAPITALS[second]
        return Example("followup", messages, city, f"The capital of {second} is {city}.")

    def tool(self) -> Example:
        # Known city names (one token each in the question and in the call): the API check is that
        # the call is well formed and names the asked city; new names are not the point here.
        city = self.rng.choice(TOOL_CITIES)
        name = self.rng.choice(["get_weather", "get_time"])
        if name == "get_weather":
            q = self.rng.choice(["What is the weather in {c}?", "Is it raining in {c}?"])
        else:
            q = self.rng.choice(["What time is it in {c}?", "Tell me the local time in {c}."])
        call = (
            f"<tool_call>\n<function={name}>\n<parameter=city>\n{city}\n</parameter>\n"
            "</function>\n</tool_call>"
        )
        return Example(
            "tool",
            [_user(q.format(c=city))],
            call,
            f"I call {name} for {city}.",
            tools=TOOLS,
            tool_call=(name, {"city": city}),
        )

    # ------------------------------------------------------------------ image families
    def colour(self) -> Example:
        pixels, colour, _ = images.one_shape(self.rng)
        q = self.rng.choice(["What colour is the shape?", "Which colour is the shape?"])
        return Example("colour", [_image_user(q)], colour, "I look at the shape.", pixels=[pixels])

    def shape(self) -> Example:
        pixels, _, shape = images.one_shape(self.rng)
        q = self.rng.choice(["What shape is this?", "Which shape do you see?"])
        return Example("shape", [_image_user(q)], shape, "I look at the shape.", pixels=[pixels])

    def count_shapes(self) -> Example:
        pic = images.several_shapes(self.rng)
        q = "How many shapes are in the picture?"
        return Example(
            "count_shapes", [_image_user(q)], pic.answer, "I count the shapes.", pixels=[pic.pixels]
        )

    def position(self) -> Example:
        pic = images.shape_in_quadrant(self.rng)
        q = "Where is the shape in the picture?"
        return Example(
            "position", [_image_user(q)], pic.answer, "I look where it is.", pixels=[pic.pixels]
        )

    def text(self) -> Example:
        chars = self._draw(
            lambda: "".join(self.rng.choice(images.TEXT_CHARS) for _ in range(3)), lambda s: s
        )
        pic = images.text_picture(chars, self.rng)
        q = self.rng.choice(["What does the text say?", "Read the text in the picture."])
        return Example("text", [_image_user(q)], chars, "I read the text.", pixels=[pic.pixels])

    def example(self, family: str) -> Example:
        return getattr(self, family)()


def generate(split: str, seed: int, per_family: dict[str, int]) -> list[Example]:
    """`per_family[f]` examples of each family f, in a seeded order."""
    gen = Generator(split, seed)
    out = [gen.example(f) for f in FAMILIES for _ in range(per_family.get(f, 0))]
    gen.rng.shuffle(out)
    return out
