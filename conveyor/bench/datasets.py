"""Benchmark workloads: request lengths and arrival times, shared by every bench command.

Prompts are token ids drawn at random from the vocabulary's ordinary tokens (no special
tokens), so their lengths are exact; `prompt_text` gives a text form for chat endpoints.
The speculative-decoding workloads (spec-edit, spec-control) are chat requests in real text
instead, since what they measure is whether the answer repeats the prompt; so is json-schema,
the structured-output workload, since a model asked for a JSON record in words writes one.
"""

from __future__ import annotations

import builtins
import io
import json
import keyword
import math
import re
import sysconfig
import textwrap
import tokenize
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np


@dataclass(slots=True)
class SampleRequest:
    prompt_token_ids: list[int]
    output_len: int
    prompt_text: str | None = None
    # A JSON schema the output is constrained to (json-schema workload); None: free text.
    schema: dict | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def _ordinary_ids(tokenizer) -> np.ndarray:
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = np.arange(len(tokenizer))
    return ids[~np.isin(ids, list(special))] if special else ids


def _lengths(rng: np.random.Generator, num: int, mean: int, range_ratio: float) -> np.ndarray:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=num)


def random_requests(
    tokenizer, num: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0
) -> list[SampleRequest]:
    """vLLM's `random` dataset: lengths uniform in [len*(1-r), len*(1+r)]."""
    rng = np.random.default_rng(seed)
    vocab = _ordinary_ids(tokenizer)
    inputs = _lengths(rng, num, input_len, range_ratio)
    outputs = _lengths(rng, num, output_len, range_ratio)
    return [
        SampleRequest(rng.choice(vocab, size=int(n)).tolist(), int(m))
        for n, m in zip(inputs, outputs, strict=True)
    ]


OUTPUT_DISTS = ("lognormal", "exponential", "uniform")
LOGNORMAL_SIGMA = 1.0  # mean / median = e^(sigma^2 / 2) = 1.65, near ShareGPT's outputs


def output_lengths(
    rng: np.random.Generator, num: int, dist: str, output_range: tuple[int, int], mean: float
) -> np.ndarray:
    """Output lengths in the closed range output_range. uniform: the Orca paper's trace;
    lognormal (sigma 1) and exponential: heavy-tailed, as the vLLM paper's ShareGPT and Alpaca
    outputs, with the given mean before capping, rounded and clipped to the range (so the
    range's ends carry the tails' mass)."""
    low, high = output_range
    if not 1 <= low <= high:
        raise ValueError(f"output range must be 1 <= MIN <= MAX, got {low} {high}")
    if dist == "uniform":
        return rng.integers(low, high + 1, size=num)
    if not mean > 0:
        raise ValueError(f"output mean must be > 0, got {mean}")
    if dist == "lognormal":
        median = mean / math.exp(LOGNORMAL_SIGMA**2 / 2)
        raw = rng.lognormal(math.log(median), LOGNORMAL_SIGMA, size=num)
    elif dist == "exponential":
        raw = rng.exponential(mean, size=num)
    else:
        raise ValueError(
            f"output distribution must be one of {', '.join(OUTPUT_DISTS)}, got {dist!r}"
        )
    return np.clip(np.rint(raw), low, high).astype(np.int64)


def uniform_requests(
    tokenizer, num: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int = 0
) -> list[SampleRequest]:
    """The Orca paper's trace shape: prompt and output lengths uniform in closed ranges."""
    return synthetic_requests(tokenizer, num, prompt_range, output_range, "uniform", 0.0, seed)


def synthetic_requests(
    tokenizer,
    num: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    output_dist: str = "uniform",
    output_mean: float = 0.0,
    seed: int = 0,
) -> list[SampleRequest]:
    """Prompt lengths uniform in prompt_range, outputs drawn by output_lengths."""
    rng = np.random.default_rng(seed)
    vocab = _ordinary_ids(tokenizer)
    inputs = rng.integers(prompt_range[0], prompt_range[1] + 1, size=num)
    outputs = output_lengths(rng, num, output_dist, output_range, output_mean)
    return [
        SampleRequest(rng.choice(vocab, size=int(n)).tolist(), int(m))
        for n, m in zip(inputs, outputs, strict=True)
    ]


def prefix_repetition_requests(
    tokenizer,
    num: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    seed: int = 0,
) -> list[SampleRequest]:
    """vLLM's `prefix-repetition` dataset: a few shared prefixes, each with random suffixes."""
    rng = np.random.default_rng(seed)
    vocab = _ordinary_ids(tokenizer)
    prefixes = [rng.choice(vocab, size=prefix_len).tolist() for _ in range(num_prefixes)]
    requests = [
        SampleRequest(
            prefixes[i % num_prefixes] + rng.choice(vocab, size=suffix_len).tolist(), output_len
        )
        for i in range(num)
    ]
    order = rng.permutation(num)
    return [requests[i] for i in order]


def sharegpt_requests(
    path: str | Path,
    tokenizer,
    num: int,
    output_len: int | None = None,
    seed: int = 0,
    max_len: int = 2048,
) -> list[SampleRequest]:
    """Conversations from a ShareGPT JSON file the user supplies: the first human turn is the
    prompt, the first reply's length (or output_len) the output length."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"ShareGPT dataset {str(path)!r} does not exist")
    data = json.loads(path.read_text())
    rng = np.random.default_rng(seed)
    requests = []
    for index in rng.permutation(len(data)):
        turns = data[index].get("conversations") or []
        if len(turns) < 2:
            continue
        prompt_ids = tokenizer(turns[0]["value"]).input_ids
        reply_len = output_len or len(tokenizer(turns[1]["value"]).input_ids)
        if len(prompt_ids) < 4 or reply_len < 4 or len(prompt_ids) + reply_len > max_len:
            continue
        requests.append(SampleRequest(list(prompt_ids), reply_len, turns[0]["value"]))
        if len(requests) == num:
            break
    if len(requests) < num:
        raise ValueError(f"{str(path)!r} has only {len(requests)} usable conversations")
    return requests


# ---- speculative decoding: answers that repeat the prompt, and answers that do not ---------

# "Keep every other line exactly" makes SmolLM2-135M-Instruct copy instead of paraphrase.
EDIT_REQUEST = (
    "Rewrite the following Python code, renaming the variable {old} to {new}. Keep every "
    "other line exactly as it is, docstrings and comments included. Output only the code."
    "\n```python\n{code}\n```"
)
CONTROL_REQUEST = (
    "Keep these house rules in mind, but do not repeat or quote them.\n{rules}\n\n"
    "Now write an original short story about {topic}."
)
CONTROL_TOPICS = (
    "a lighthouse keeper who finds a map in a bottle",
    "a robot learning to bake bread",
    "two rival chess players stranded in a snowstorm",
    "a city where it rains only on Tuesdays",
    "a child who can hear what trees think",
    "the last bookshop on the moon",
    "a detective who is afraid of the dark",
    "a river that changes its course overnight",
    "a violinist who loses her hearing",
    "an old dog guarding a forgotten garden",
    "a train that never reaches its last station",
    "a beekeeper who receives a letter from the queen bee",
    "a painter who can only paint the future",
    "a village that trades in memories",
    "a sailor who counts the stars every night",
    "the first winter on a new planet",
)
# An instruction preamble with nothing for the answer to copy: style rules for the story.
CONTROL_RULES = (
    "Prefer concrete nouns and active verbs over abstractions.",
    "Give every character a small, specific habit the reader can picture.",
    "Open in the middle of an action rather than with the weather.",
    "Keep paragraphs short, rarely more than four sentences.",
    "Let the dialogue carry the conflict instead of the narration.",
    "Avoid clichés such as a heart pounding or a blood running cold.",
    "Use the senses of smell and touch at least once each.",
    "End on an image, not on a moral or an explanation.",
    "Vary the length of sentences so the rhythm never settles.",
    "Do not name more than three characters.",
    "Show the passing of time through objects that change.",
    "Cut adverbs wherever a stronger verb can replace them.",
    "Let the setting shape what the characters are able to do.",
    "Give the main character a want and an obstacle in the first page.",
    "Write in the past tense and keep the point of view steady.",
    "Use humour sparingly, and never at the expense of the stakes.",
    "Avoid dream sequences and flashbacks longer than a paragraph.",
    "Make the turning point depend on a choice the character makes.",
    "Keep technical words to a minimum and explain none of them.",
    "Let a minor character surprise the reader once.",
    "Prefer plain words to rare ones when both fit.",
    "Do not begin two consecutive sentences with the same word.",
    "Let silence and pauses appear in at least one conversation.",
    "Describe a place through what is missing from it.",
    "Make the title a phrase that appears nowhere in the text.",
    "Keep exclamation marks out of the narration.",
    "Give the weather a role only if it changes the plot.",
    "Use numbers sparingly, spelled out when they are small.",
    "Make the reader guess one thing before the character does.",
    "Keep the ending open enough to invite a second reading.",
)
_NOT_VARIABLES = set(keyword.kwlist) | set(keyword.softkwlist) | set(dir(builtins))
_NOT_VARIABLES |= {"self", "cls"}


def _chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """The prompt a chat endpoint would build for one user message: the tokenizer's chat
    template with the assistant's turn opened, or the plain text when it has none (a base or
    tiny test model)."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer(text).input_ids
    messages = [{"role": "user", "content": text}]
    templated = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(templated, add_special_tokens=False).input_ids


def _stdlib_sources() -> list[Path]:
    """Real code that every installation has: the top-level modules of Python's stdlib."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def _code_snippet(tokenizer, rng: np.random.Generator, files: list[Path], min_tokens: int) -> str:
    """Whole lines from a random `def` or `class` of a random stdlib module on, until they
    hold at least min_tokens tokens (counted line by line, so roughly)."""
    while True:
        lines = files[rng.integers(len(files))].read_text(errors="replace").splitlines()
        starts = [i for i, line in enumerate(lines) if re.match(r"\s*(def|class) ", line)]
        if not starts:
            continue
        start = starts[rng.integers(len(starts))]
        count = 0
        for end in range(start, len(lines)):
            count += len(tokenizer("\n" + lines[end], add_special_tokens=False).input_ids)
            if count >= min_tokens:
                return textwrap.dedent("\n".join(lines[start : end + 1]))


def _variable(code: str) -> str | None:
    """The name the code uses most (in code, not in strings or comments; not a keyword,
    builtin, self or attribute; ties: the first seen), so that renaming it changes many
    lines; None when it has none. A snippet may end inside a bracket or a string: the names
    before that point count."""
    names: Counter[str] = Counter()
    previous = ""
    try:
        for token in tokenize.generate_tokens(io.StringIO(code).readline):
            name = token.string
            if token.type == tokenize.NAME and previous != "." and name not in _NOT_VARIABLES:
                names[name] += 1
            previous = name
    except (tokenize.TokenError, SyntaxError):
        pass
    return names.most_common(1)[0][0] if names else None


def spec_edit_requests(
    tokenizer, num: int, input_len: int, output_len: int, seed: int = 0
) -> list[SampleRequest]:
    """Code-editing chat requests whose answer is mostly the prompt's code again (the case
    n-gram speculation is for): rename a variable in a stdlib snippet, about input_len prompt
    tokens in all. The snippet has at least output_len tokens, so that an answer that copies
    it runs to the full output length, and more where that makes the prompt longer."""
    rng = np.random.default_rng(seed)
    files = _stdlib_sources()
    empty = EDIT_REQUEST.format(old="name", new="new_name", code="")
    code_tokens = max(input_len - len(_chat_prompt_ids(tokenizer, empty)), output_len)
    requests = []
    while len(requests) < num:
        code = _code_snippet(tokenizer, rng, files, code_tokens)
        old = _variable(code)
        if old is None:
            continue
        text = EDIT_REQUEST.format(old=old, new=f"new_{old.lstrip('_')}", code=code)
        requests.append(SampleRequest(_chat_prompt_ids(tokenizer, text), output_len, text))
    return requests


def spec_control_requests(
    tokenizer, num: int, input_len: int, output_len: int, seed: int = 0
) -> list[SampleRequest]:
    """The control for spec-edit: chat requests of about the same length whose answer (an
    original story) has nothing in the prompt to copy. The length comes from a preamble of
    style rules in a random order (cycled when one pass is too short)."""
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(num):
        topic = CONTROL_TOPICS[rng.integers(len(CONTROL_TOPICS))]
        order = rng.permutation(len(CONTROL_RULES))
        rules: list[str] = []
        while True:
            rules.append(f"- {CONTROL_RULES[order[len(rules) % len(order)]]}")
            text = CONTROL_REQUEST.format(rules="\n".join(rules), topic=topic)
            prompt_ids = _chat_prompt_ids(tokenizer, text)
            if len(prompt_ids) >= input_len:
                break
        requests.append(SampleRequest(prompt_ids, output_len, text))
    return requests


SPEC_WORKLOADS = {"spec-edit": spec_edit_requests, "spec-control": spec_control_requests}


# ---- structured output: chat requests for a JSON record, constrained to its schema or free ---

JSON_REQUEST_END = " Reply with the JSON object only."
NAME_SYLLABLES = "ka lo mer vi tan so rel do pim zu ar be nix ol qua ren sha tor ul wen".split()


class JsonTask(NamedTuple):
    """One kind of JSON record: the request (naming every field, so that a model without the
    constraint writes much the same JSON), what it is about, its schema (every string and
    array bounded, so a complete record is short) and a record that fits the schema."""

    prompt: str  # with {subject} and {name}
    subjects: list[str]
    schema: dict  # its "title" names it in response_format
    example: dict


def _object(properties: dict, required: list[str], title: str | None = None) -> dict:
    """An object with no keys but its properties (what `strict` makes of it anyway)."""
    return ({"title": title} if title else {}) | {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def _text(max_length: int) -> dict:
    return {"type": "string", "maxLength": max_length}


def _list(items: dict, max_items: int) -> dict:
    return {"type": "array", "items": items, "maxItems": max_items}


def _enum(values: str) -> dict:
    return {"type": "string", "enum": _phrases(values)}


def _phrases(text: str) -> list[str]:
    return text.split(", ")


JSON_TASKS = (
    JsonTask(
        "Describe a fictional product, {subject} called {name}, as a JSON object with the "
        "fields name, price (a number), currency (USD, EUR, GBP or JPY), tags (a list of at "
        "most 4 keywords), in_stock (true or false) and, if it has one, sku (three capital "
        "letters, a dash and four digits).",
        _phrases(
            "a hiking backpack, a desk lamp, a coffee grinder, a pair of running shoes, "
            "a board game, a mechanical keyboard, a garden hose, a travel mug"
        ),
        _object(
            {
                "name": _text(40),
                "price": {"type": "number", "minimum": 0, "maximum": 10000},
                "currency": _enum("USD, EUR, GBP, JPY"),
                "tags": _list(_text(16), 4),
                "in_stock": {"type": "boolean"},
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            },
            ["name", "price", "currency", "tags", "in_stock"],
            title="product",
        ),
        {
            "name": "Trail Pack 30",
            "price": 89.5,
            "currency": "EUR",
            "tags": ["outdoor", "light"],
            "in_stock": True,
            "sku": "TRL-0030",
        },
    ),
    JsonTask(
        "Write the profile of a fictional {subject} named {name} as a JSON object with the "
        "fields name, age (18 to 99), email (like first.last@example.com), address (an object "
        "with street, city and postal_code, five digits) and skills (a list of at most 3).",
        _phrases(
            "carpenter, nurse, software engineer, baker, pilot, librarian, photographer, farmer"
        ),
        _object(
            {
                "name": _text(32),
                "age": {"type": "integer", "minimum": 18, "maximum": 99},
                "email": {
                    "type": "string",
                    "pattern": "^[a-z]{1,12}\\.[a-z]{1,12}@[a-z]{1,10}\\.(com|org|net)$",
                },
                "address": _object(
                    {
                        "street": _text(40),
                        "city": _text(24),
                        "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
                    },
                    ["street", "city", "postal_code"],
                ),
                "skills": _list(_text(24), 3),
            },
            ["name", "age", "email", "address"],
            title="person",
        ),
        {
            "name": "Ana Berg",
            "age": 41,
            "email": "ana.berg@example.com",
            "address": {"street": "12 Mill Road", "city": "Leeds", "postal_code": "40210"},
            "skills": ["joinery", "restoration"],
        },
    ),
    JsonTask(
        "Announce a fictional {subject} called {name} as a JSON object with the fields title, "
        "category (concert, conference, sports, festival, meetup or exhibition), date "
        "(YYYY-MM-DD), venue (an object with name, city and capacity, a whole number), "
        "speakers (up to 3 names) and, if tickets are sold, ticket_price (a number).",
        _phrases(
            "jazz concert, science conference, football match, food festival, chess meetup, "
            "photo exhibition, film festival, marathon"
        ),
        _object(
            {
                "title": _text(48),
                "category": _enum("concert, conference, sports, festival, meetup, exhibition"),
                "date": {
                    "type": "string",
                    "pattern": "^20[2-3][0-9]-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$",
                },
                "venue": _object(
                    {
                        "name": _text(32),
                        "city": _text(24),
                        "capacity": {"type": "integer", "minimum": 10, "maximum": 100000},
                    },
                    ["name", "city", "capacity"],
                ),
                "speakers": _list(_text(24), 3),
                "ticket_price": {"type": "number", "minimum": 0, "maximum": 500},
            },
            ["title", "category", "date", "venue", "speakers"],
            title="event",
        ),
        {
            "title": "Night of Brass",
            "category": "concert",
            "date": "2025-06-14",
            "venue": {"name": "Blue Hall", "city": "Lyon", "capacity": 800},
            "speakers": ["Mia Holt"],
            "ticket_price": 25,
        },
    ),
    JsonTask(
        "Invent a {subject} recipe called {name} and give it as a JSON object with the fields "
        "name, cuisine (italian, mexican, indian, japanese, french or other), servings (1 to "
        "12), minutes (5 to 240), vegetarian (true or false) and ingredients (up to 5 objects "
        "with item and amount).",
        _phrases("soup, pasta, curry, salad, cake, stew, sandwich, noodle"),
        _object(
            {
                "name": _text(40),
                "cuisine": _enum("italian, mexican, indian, japanese, french, other"),
                "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                "minutes": {"type": "integer", "minimum": 5, "maximum": 240},
                "vegetarian": {"type": "boolean"},
                "ingredients": _list(
                    _object({"item": _text(20), "amount": _text(12)}, ["item", "amount"]), 5
                ),
            },
            ["name", "cuisine", "servings", "minutes", "vegetarian", "ingredients"],
            title="recipe",
        ),
        {
            "name": "Green Soup",
            "cuisine": "french",
            "servings": 4,
            "minutes": 35,
            "vegetarian": True,
            "ingredients": [{"item": "leeks", "amount": "2"}, {"item": "peas", "amount": "300 g"}],
        },
    ),
    JsonTask(
        "Review a fictional {subject} titled {name} as a JSON object with the fields title, "
        "author, year (between 1900 and 2025), rating (a number from 0 to 5), genres (up to 3 of "
        "fiction, mystery, romance, science, history, fantasy or biography) and summary (one "
        "short sentence).",
        _phrases(
            "novel, detective story, travel book, history book, cookbook, fantasy saga, "
            "biography, poetry collection"
        ),
        _object(
            {
                "title": _text(48),
                "author": _text(32),
                "year": {"type": "integer", "minimum": 1900, "maximum": 2025},
                "rating": {"type": "number", "minimum": 0, "maximum": 5},
                "genres": _list(
                    _enum("fiction, mystery, romance, science, history, fantasy, biography"), 3
                ),
                "summary": _text(120),
            },
            ["title", "author", "year", "rating", "genres", "summary"],
            title="review",
        ),
        {
            "title": "The Salt Road",
            "author": "J. Marr",
            "year": 1998,
            "rating": 4.5,
            "genres": ["fiction", "history"],
            "summary": "A trader crosses the desert.",
        },
    ),
)


def _fictional_name(rng: np.random.Generator) -> str:
    """A made-up name of 2-3 syllables: it keeps every prompt of a run distinct (so no prompt
    is in the prefix cache from another run) without telling the model what to write."""
    count = 2 + int(rng.integers(2))
    name = "".join(NAME_SYLLABLES[i] for i in rng.integers(len(NAME_SYLLABLES), size=count))
    return name.capitalize()


def constrained_indices(num: int, ratio: float) -> list[int]:
    """Which of num requests are constrained: round(ratio * num) of them (halves up), spread
    evenly from the first, so any stretch of the run holds about the same share."""
    if not 0 <= ratio <= 1:
        raise ValueError(f"structured ratio must be in [0, 1], got {ratio}")
    count = math.floor(ratio * num + 0.5)
    return [j * num // count for j in range(count)] if count else []


def json_schema_requests(
    tokenizer, num: int, output_len: int, ratio: float = 1.0, seed: int = 0
) -> list[SampleRequest]:
    """Chat requests for a JSON record (JSON_TASKS: products, people, events, recipes,
    reviews), each about a random subject and a made-up name; round(ratio * num) of them,
    spread evenly, carry the task's schema, the rest are the same kind of request unconstrained.
    Each part cycles through the tasks on its own, so both hold every schema about equally."""
    rng = np.random.default_rng(seed)
    constrained = set(constrained_indices(num, ratio))
    seen = {True: 0, False: 0}
    requests = []
    for i in range(num):
        is_constrained = i in constrained
        task = JSON_TASKS[seen[is_constrained] % len(JSON_TASKS)]
        seen[is_constrained] += 1
        subject = task.subjects[rng.integers(len(task.subjects))]
        text = task.prompt.format(subject=subject, name=_fictional_name(rng)) + JSON_REQUEST_END
        schema = task.schema if is_constrained else None
        requests.append(SampleRequest(_chat_prompt_ids(tokenizer, text), output_len, text, schema))
    return requests


def arrival_times(
    num: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Seconds from the start at which each request is sent. Gamma inter-arrival times with
    shape `burstiness` and mean 1/rate (burstiness 1 is a Poisson process); rate inf: all at 0."""
    if request_rate == math.inf:
        return [0.0] * num
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be > 0")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def check_workload_args(args) -> None:
    positive = [
        "num_prompts",
        "random_input_len",
        "random_output_len",
        "prefix_repetition_prefix_len",
        "prefix_repetition_num_prefixes",
        "prefix_repetition_output_len",
        "spec_input_len",
        "spec_output_len",
        "structured_output_len",
    ]
    for name in positive:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.prefix_repetition_suffix_len < 0:
        raise ValueError("--prefix-repetition-suffix-len must be >= 0")
    if args.sharegpt_output_len is not None and args.sharegpt_output_len < 1:
        raise ValueError("--sharegpt-output-len must be >= 1")
    if not 0 <= args.structured_ratio <= 1:
        raise ValueError(f"--structured-ratio must be in [0, 1], got {args.structured_ratio}")


def sample_requests(args, tokenizer) -> list[SampleRequest]:
    check_workload_args(args)
    if args.dataset_name == "random":
        return random_requests(
            tokenizer,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
        )
    if args.dataset_name == "prefix-repetition":
        return prefix_repetition_requests(
            tokenizer,
            args.num_prompts,
            args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len,
            args.seed,
        )
    if args.dataset_name in SPEC_WORKLOADS:
        build = SPEC_WORKLOADS[args.dataset_name]
        return build(
            tokenizer, args.num_prompts, args.spec_input_len, args.spec_output_len, args.seed
        )
    if args.dataset_name == "json-schema":
        return json_schema_requests(
            tokenizer,
            args.num_prompts,
            args.structured_output_len,
            args.structured_ratio,
            args.seed,
        )
    if not args.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path (a ShareGPT JSON file)")
    return sharegpt_requests(
        args.dataset_path, tokenizer, args.num_prompts, args.sharegpt_output_len, args.seed
    )
