"""The shipped sample dataset: natural-language requests → one strict JSON tool call.

``python -m scripts.make_sample samples/toolcalls`` regenerates ``samples/toolcalls/`` byte for
byte (seed ``SEED``, 3000 examples). The demo fine-tunes SmolLM2-135M-Instruct with LoRA on two CPU
cores for a few minutes, and the fine-tuned model must beat the base by at least 30 points of exact
match on the assistant reply. The task is shaped for that:

- Learnable fast. Six fixed tools (``TOOLS``) and 5-6 short phrasings per tool; every argument is
  copied from the request or normalized by a small closed rule: city names are title-cased, units
  become one of 12 abbreviations or ``celsius``/``fahrenheit``, ``6:30 pm`` becomes ``18:30``,
  ``March 4, 2026`` becomes ``2026-03-04``. No arithmetic, no world knowledge.
- Unambiguous. Each request has exactly one target, ``canonical_call(name, arguments)``::

      {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}

  i.e. ``json.dumps`` with its defaults (separators ``", "`` and ``": "``, ``ensure_ascii``; all
  argument values are ASCII so no escape ever appears), key order ``name`` then ``arguments``, and
  the arguments in the order ``TOOLS`` lists them. Numbers are JSON numbers (``12``, ``2.5``);
  everything else is a string. Requests are unique after case-folding and whitespace collapsing.
- Short. The system prompt is one fixed 12-token sentence with no tool list (the six tools as
  terse JSON schemas are 323 tokens, more than four whole rows). With SmolLM2's chat template a
  conversation is 50-110 tokens, mean 74, p95 95, of which the reply is 31 on average; the long rows
  below are the tail (mean 91). The base model cannot score: it has never seen these tool names or
  this JSON shape, so every point of exact match is learned.

One example in ``LONG_EVERY`` uses a chatty 22-30 word phrasing. Those long requests are what the
near-duplicates are made from: appending "Thanks!" or prepending "Hi there." keeps the request's
word 5-gram Jaccard at 0.857 or more (mean 0.93), so a 5-gram MinHash at threshold 0.8 finds them,
while two distinct requests never exceed 0.667: short rows such as "Convert 12 km to m." and
"Convert 19 km to m." differ in one number and are NOT duplicates. Shingle the user request only:
over system + request + answer the edit sits mid-text and the pairs fall to 0.73-0.82 (mean 0.78),
so a threshold of 0.8 would catch 20 of the 90.

``write_sample`` spreads the examples over three formats and adds dirt at exact, reported counts
(rates are fractions of ``n``):

- ``part-000.jsonl``: chat ``{"messages": [{"role", "content"}]}``, UTF-8 BOM at the start.
- ``part-001.jsonl.gz``: ShareGPT ``{"conversations": [{"from": system|human|gpt, "value"}]}``.
- ``part-002.jsonl``: alpaca ``{"instruction", "input", "output"}``, CRLF line endings. Half the
  rows carry the system prompt as ``instruction`` and the request as ``input``; the other half put
  the request in ``instruction`` with ``input`` empty or absent. Read a non-empty ``input`` as the
  user turn and ``instruction`` as the system turn, else ``instruction`` as the user turn and no
  system turn: only then is a row copied here from another format an exact duplicate.

Dirt, as extra lines unless said otherwise:

- exact duplicates: a byte-identical copy of a line, the same conversation with its request
  lower-cased or its spaces doubled, or the same conversation written in another file's format.
  Equal after case-folding and collapsing whitespace of every turn.
- near duplicates: a long request with "Thanks!"-style words appended or prepended, same answer.
- malformed lines: truncated JSON, a bare list or number, a Python repr, a line of garbage.
- wrong roles: assistant first, two user turns in a row, or an unknown role ``bot2``.
- empty answers: the assistant turn is ``""`` or whitespace.
- blank lines: empty or whitespace-only.
- needs normalizing (kept rows, changed in place): a non-breaking space instead of a space, a stray
  control character before a space, or trailing whitespace on the request or the answer. Replacing
  U+00A0 by a space, deleting control characters and stripping each turn restores the clean row.

After validation, cleaning and both deduplications exactly ``n`` examples remain.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path

SYSTEM_PROMPT = "Reply with exactly one JSON tool call and nothing else."  # 12 tokens; see "Short" above
SEED = 20261101  # the seed of the shipped files
N_EXAMPLES = 3000  # ~500 per tool; 223k tokens an epoch, so a few-minute CPU budget sees a good part of it
MAX_REDRAWS = 1000  # a tool that repeats this often has run out of phrasings: fail instead of looping
LONG_EVERY = 8  # every 8th request is long (22-30 words): 375 sources for 90 near-duplicates

TOOLS: dict[str, tuple[str, ...]] = {  # tool name → argument names, in canonical order
    "get_weather": ("city", "unit"),
    "set_timer": ("minutes",),
    "convert_units": ("value", "from_unit", "to_unit"),
    "send_email": ("to", "subject"),
    "create_reminder": ("text", "time"),
    "search_flights": ("origin", "destination", "date"),
}

FILES = ("part-000.jsonl", "part-001.jsonl.gz", "part-002.jsonl")
FORMAT_SHARES = (0.4, 0.3, 0.3)  # of the n examples, per file in FILES order
DIRT_RATES = {  # extra lines per example, except needs_normalizing which edits kept rows in place
    "exact_duplicates": 0.05,
    "near_duplicates": 0.03,
    "malformed": 0.01,
    "wrong_roles": 0.01,
    "empty_answers": 0.01,
    "needs_normalizing": 0.01,
}
BLANK_LINES = {"part-000.jsonl": ["", "   "], "part-002.jsonl": [""]}  # empty and whitespace-only

CITIES = [
    "Paris",
    "Tokyo",
    "Berlin",
    "New York",
    "Cairo",
    "Lima",
    "Oslo",
    "Madrid",
    "Toronto",
    "Sydney",
    "Nairobi",
    "Mumbai",
    "Seoul",
    "Chicago",
    "Lisbon",
    "Dublin",
    "Rome",
    "Vienna",
    "Prague",
    "Warsaw",
    "Athens",
    "Istanbul",
    "Dubai",
    "Singapore",
    "Bangkok",
    "Jakarta",
    "Manila",
    "Hanoi",
    "Beijing",
    "Shanghai",
    "Boston",
    "Denver",
    "Seattle",
    "Austin",
    "Miami",
    "Mexico City",
    "Buenos Aires",
    "Santiago",
    "Bogota",
    "Cape Town",
    "Lagos",
    "Accra",
    "Helsinki",
    "Stockholm",
    "Copenhagen",
    "Amsterdam",
    "Brussels",
    "Zurich",
    "Montreal",
    "Vancouver",
]
LOWERCASE_CITY_RATE = 0.15  # users often type "paris"; the target is always "Paris"

WEATHER_UNITS = {  # target → how a request may say it
    "celsius": ["celsius", "Celsius", "°C", "degrees Celsius"],
    "fahrenheit": ["fahrenheit", "Fahrenheit", "°F", "degrees Fahrenheit"],
}
WEATHER_SHORT = [
    "What's the weather in {city} in {unit}?",
    "Weather for {city}, {unit} please.",
    "How warm is it in {city}? Use {unit}.",
    "Tell me the temperature in {city} in {unit}.",
    "Forecast for {city} ({unit})",
    "is it cold in {city}? answer in {unit}",
]
# Long templates keep every slot at least 4 words from either end, so one changed slot changes 5
# of ~20 word 5-grams: two distinct long requests stay at Jaccard ≤ 0.67.
WEATHER_LONG = [
    "I'm packing for a trip, so could you check the weather in {city} and give it in {unit} so I know what to pack?",
    "My parents live in {city} and I worry about them, so look up the weather there and give me the "
    "temperature in {unit} when you have a moment.",
    "Before I pick an outfit for the concert tonight, please get the weather for {city} in {unit} and "
    "keep the answer short.",
]

TIMER_MINUTES = range(2, 181)  # from 2: "1 minutes" would read wrong in every template
TIMER_SHORT = [
    "Set a timer for {minutes} minutes.",
    "Start a {minutes}-minute timer.",
    "Timer for {minutes} min please",
    "Can you time {minutes} minutes for me?",
    "countdown {minutes} minutes",
    "set timer {minutes} mins",
]
TIMER_LONG = [
    "I'm about to put a frozen pizza in the oven, so please set a timer for {minutes} minutes and tell "
    "me when it is done.",
    "Could you start a timer for {minutes} minutes right now? I want to take a short nap and really "
    "should not oversleep today.",
    "The kids get screen time until the timer runs out, so set one for {minutes} minutes and make sure "
    "it rings loudly at the end.",
]

UNITS = {  # abbreviation (the target) → (singular, plural, quantity); pairs share a quantity
    "km": ("kilometer", "kilometers", "length"),
    "m": ("meter", "meters", "length"),
    "cm": ("centimeter", "centimeters", "length"),
    "mi": ("mile", "miles", "length"),
    "ft": ("foot", "feet", "length"),
    "kg": ("kilogram", "kilograms", "mass"),
    "g": ("gram", "grams", "mass"),
    "lb": ("pound", "pounds", "mass"),
    "oz": ("ounce", "ounces", "mass"),
    "l": ("liter", "liters", "volume"),
    "ml": ("milliliter", "milliliters", "volume"),
    "gal": ("gallon", "gallons", "volume"),
}
DECIMAL_VALUE_RATE = 0.3  # "2.5 km" → 2.5 (a JSON float); the rest are integers 1-500
CONVERT_SHORT = [
    "Convert {value} {from_unit} to {to_unit}.",
    "How many {to_unit} is {value} {from_unit}?",
    "{value} {from_unit} in {to_unit}?",
    "What is {value} {from_unit} in {to_unit}?",
    "please convert {value} {from_unit} into {to_unit}",
]
CONVERT_LONG = [
    "I keep mixing up my units when I do homework, so could you please convert {value} {from_unit} to "
    "{to_unit} and show me the number?",
    "For a report I am writing at work I need {value} {from_unit} expressed in {to_unit}, can you run "
    "the conversion for me please?",
    "Quick question while I am filling in this shipping form: how many {to_unit} are there in {value} "
    "{from_unit}, give or take a little?",
]

FIRST_NAMES = [
    "alice",
    "bob",
    "carol",
    "dave",
    "erin",
    "frank",
    "grace",
    "heidi",
    "ivan",
    "judy",
    "mallory",
    "nina",
    "oscar",
    "peggy",
    "quinn",
    "rupert",
    "sybil",
    "trent",
    "uma",
    "victor",
    "wendy",
    "xavier",
    "yara",
    "zoe",
    "liam",
    "mia",
    "noah",
    "priya",
    "omar",
    "chen",
    "fatima",
    "diego",
]
LAST_NAMES = ["smith", "garcia", "chen", "okafor", "novak", "silva", "kim", "muller", "rossi", "khan"]
DOMAINS = ["example.com", "acme.org", "mail.net", "corp.io", "school.edu", "startup.dev"]
SUBJECTS = [
    "Budget review",
    "Lunch on Friday",
    "Q3 report",
    "Project kickoff",
    "Invoice 2041",
    "Team offsite",
    "Quick question",
    "Meeting notes",
    "Holiday schedule",
    "Contract renewal",
    "Bug in checkout",
    "Welcome aboard",
    "Flight details",
    "Rent payment",
    "Design feedback",
    "Weekly sync",
    "Conference tickets",
    "New hire onboarding",
    "Server outage",
    "Birthday party",
    "Book club",
    "Pull request review",
    "Parking permit",
    "Quarterly goals",
    "Thank you",
    "Travel expenses",
    "Launch checklist",
    "Interview schedule",
    "Office move",
    "Password reset",
]
EMAIL_SHORT = [
    'Send an email to {to} with the subject "{subject}".',
    'Email {to} about "{subject}".',
    "Write to {to}, subject: {subject}",
    'Can you email {to}? Subject line: "{subject}".',
    'mail {to} titled "{subject}"',
]
EMAIL_LONG = [
    "I have been meaning to follow up with my colleague, so please send an email to {to} with the "
    'subject "{subject}" as soon as possible.',
    'Could you draft and send a short message to {to} for me? Use "{subject}" as the subject line so '
    "they know what it is about.",
    'My manager asked me to loop someone in today, so email {to} and put "{subject}" in the subject, '
    "nothing fancy needed.",
]

REMINDER_TEXTS = [
    "call mom",
    "water the plants",
    "pay the rent",
    "book a dentist appointment",
    "take out the trash",
    "submit the report",
    "buy milk",
    "pick up the kids",
    "feed the cat",
    "renew my passport",
    "stretch",
    "take my medicine",
    "check the oven",
    "move the car",
    "send the invoice",
    "charge my phone",
    "walk the dog",
    "join the standup",
    "back up my laptop",
    "call the plumber",
    "order groceries",
    "reply to Sam",
    "pack my gym bag",
    "cancel the subscription",
    "lock the door",
    "review the slides",
    "drink some water",
    "print the tickets",
    "pay the electricity bill",
    "start the laundry",
]
REMINDER_SHORT = [
    "Remind me to {text} at {time}.",
    "Set a reminder for {time} to {text}.",
    "At {time} remind me to {text}.",
    "reminder: {text} at {time}",
    "Don't forget: {text} at {time}.",
]
REMINDER_LONG = [
    "I always forget the small things when work gets busy, so please remind me to {text} at {time} "
    "today, it really matters.",
    "My week is completely packed and my memory is terrible lately, so could you set a reminder at "
    "{time} to {text} before the day is over?",
    "Please make sure I remember to {text} at {time}, because last time I forgot and it caused a lot "
    "of trouble at home.",
]

MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
FLIGHT_YEARS = (2026, 2027)
FLIGHT_SHORT = [
    "Find flights from {origin} to {destination} on {date}.",
    "Flights {origin} to {destination}, {date}",
    "Search for a flight from {origin} to {destination} on {date}.",
    "I need to fly {origin} -> {destination} on {date}.",
    "any flights {origin} to {destination} {date}?",
]
FLIGHT_LONG = [
    "My sister is getting married soon, so please search for flights from {origin} to {destination} on "
    "{date} and show me what is available.",
    "Work is sending me to a conference, could you look for flights from {origin} to {destination} "
    "leaving on {date}? Economy class is totally fine.",
    "We want a cheap family holiday this year, so find me flights from {origin} to {destination} for "
    "{date} if there are any left.",
]

NEAR_DUP_APPENDS = ["Thanks!", "Thank you.", "Cheers!", "thanks a lot"]  # ≤ 3 words: Jaccard ≥ 0.85
NEAR_DUP_PREPENDS = ["Hi there.", "Hello!", "Quick one:", "Hey."]
CONTROL_CHARS = ["\x07", "\x00", "\x1b", "\x7f"]  # bell, NUL, escape, delete: what copy-paste leaves


@dataclass(frozen=True)
class ToolCallExample:
    """One clean example: the user's request and the single correct reply."""

    request: str
    target: str  # canonical_call(tool, arguments)
    tool: str


def canonical_call(name: str, arguments: dict[str, object]) -> str:
    """The one accepted reply for a call: json.dumps defaults, arguments in ``TOOLS`` order."""
    if name not in TOOLS:
        raise ValueError(f"unknown tool {name!r}; known tools: {', '.join(TOOLS)}")
    if set(arguments) != set(TOOLS[name]):
        raise ValueError(f"{name} takes arguments {TOOLS[name]}, got {tuple(arguments)}")
    return json.dumps({"name": name, "arguments": {key: arguments[key] for key in TOOLS[name]}})


def _city_as_typed(rng: random.Random, city: str) -> str:
    return city.lower() if rng.random() < LOWERCASE_CITY_RATE else city


def _weather(rng: random.Random, template: str) -> tuple[str, dict[str, object]]:
    city, unit = rng.choice(CITIES), rng.choice(list(WEATHER_UNITS))
    request = template.format(city=_city_as_typed(rng, city), unit=rng.choice(WEATHER_UNITS[unit]))
    return request, {"city": city, "unit": unit}


def _timer(rng: random.Random, template: str) -> tuple[str, dict[str, object]]:
    minutes = rng.choice(TIMER_MINUTES)
    return template.format(minutes=minutes), {"minutes": minutes}


def _unit_as_typed(rng: random.Random, unit: str, plural: bool) -> str:
    singular, plural_name, _ = UNITS[unit]
    return rng.choice([unit, plural_name if plural else singular])


def _convert(rng: random.Random, template: str) -> tuple[str, dict[str, object]]:
    from_unit = rng.choice(list(UNITS))
    to_unit = rng.choice([u for u in UNITS if u != from_unit and UNITS[u][2] == UNITS[from_unit][2]])
    value: float = rng.randint(1, 500)
    if rng.random() < DECIMAL_VALUE_RATE:
        value = rng.randint(0, 99) + rng.choice([0.25, 0.5, 0.75])
    request = template.format(
        value=value,
        from_unit=_unit_as_typed(rng, from_unit, plural=value != 1),
        to_unit=_unit_as_typed(rng, to_unit, plural=True),
    )
    return request, {"value": value, "from_unit": from_unit, "to_unit": to_unit}


def _email(rng: random.Random, template: str) -> tuple[str, dict[str, object]]:
    local = rng.choice(FIRST_NAMES)
    if rng.random() < 0.5:
        local += "." + rng.choice(LAST_NAMES)
    to, subject = f"{local}@{rng.choice(DOMAINS)}", rng.choice(SUBJECTS)
    return template.format(to=to, subject=subject), {"to": to, "subject": subject}


def _time_as_typed(rng: random.Random, hour: int, minute: int) -> str:
    """``18:30`` as a user writes it: ``18:30``, ``6:30 pm``, ``6:30PM`` or ``6 pm`` (on the hour)."""
    if hour in (0, 12) or rng.random() < 0.4:  # midnight and noon only as 00:xx / 12:xx: "12 am" trips people
        return f"{hour:02d}:{minute:02d}"
    suffix = "pm" if hour > 12 else "am"
    clock = str(hour % 12) if minute == 0 else f"{hour % 12}:{minute:02d}"
    return clock + rng.choice(["", " "]) + rng.choice([suffix, suffix.upper()])


def _reminder(rng: random.Random, template: str) -> tuple[str, dict[str, object]]:
    text, hour, minute = rng.choice(REMINDER_TEXTS), rng.randrange(24), rng.choice([0, 15, 30, 45])
    request = template.format(text=text, time=_time_as_typed(rng, hour, minute))
    return request, {"text": text, "time": f"{hour:02d}:{minute:02d}"}


def _flight(rng: random.Random, template: str) -> tuple[str, dict[str, object]]:
    origin, destination = rng.sample(CITIES, 2)
    year, month, day = rng.choice(FLIGHT_YEARS), rng.randint(1, 12), rng.randint(1, 28)
    iso, month_name = f"{year}-{month:02d}-{day:02d}", MONTHS[month - 1]
    date_as_typed = rng.choice([iso, f"{month_name} {day}, {year}", f"{day} {month_name} {year}"])
    request = template.format(
        origin=_city_as_typed(rng, origin), destination=_city_as_typed(rng, destination), date=date_as_typed
    )
    return request, {"origin": origin, "destination": destination, "date": iso}


PHRASINGS = {  # tool → (render, short templates, long templates)
    "get_weather": (_weather, WEATHER_SHORT, WEATHER_LONG),
    "set_timer": (_timer, TIMER_SHORT, TIMER_LONG),
    "convert_units": (_convert, CONVERT_SHORT, CONVERT_LONG),
    "send_email": (_email, EMAIL_SHORT, EMAIL_LONG),
    "create_reminder": (_reminder, REMINDER_SHORT, REMINDER_LONG),
    "search_flights": (_flight, FLIGHT_SHORT, FLIGHT_LONG),
}


def dedup_key(text: str) -> str:
    """Case-folded, whitespace-collapsed text: equal keys are exact duplicates."""
    return " ".join(text.casefold().split())


def generate_toolcall_rows(n: int, seed: int) -> list[ToolCallExample]:
    """``n`` clean examples, tools drawn uniformly, requests pairwise distinct by ``dedup_key``.

    Example ``i`` is long when ``i % LONG_EVERY == 0``. A request seen before is redrawn with the same
    tool, so repeats do not skew the tool mix towards the tools with more phrasings. The first ``n``
    of ``generate_toolcall_rows(n + k, seed)`` are ``generate_toolcall_rows(n, seed)``.
    """
    rng = random.Random(seed)
    examples: list[ToolCallExample] = []
    seen: set[str] = set()
    while len(examples) < n:
        tool = rng.choice(list(TOOLS))
        render, short, long = PHRASINGS[tool]
        for _ in range(MAX_REDRAWS):
            request, arguments = render(rng, rng.choice(long if len(examples) % LONG_EVERY == 0 else short))
            if dedup_key(request) not in seen:
                break
        else:
            raise ValueError(
                f"{tool} ran out of distinct requests after {len(examples)} examples; ask for fewer than {n}"
            )
        seen.add(dedup_key(request))
        examples.append(ToolCallExample(request, canonical_call(tool, arguments), tool))
    return examples


Turns = list[tuple[str, str]]  # (chat role, content)

SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt", "bot2": "bot2"}


def _turns(example: ToolCallExample, with_system: bool = True) -> Turns:
    system = [("system", SYSTEM_PROMPT)] if with_system else []
    return [*system, ("user", example.request), ("assistant", example.target)]


def _line(file: str, turns: Turns, rng: random.Random) -> str:
    """One JSON line of ``turns`` in the format of ``file``."""
    if file == "part-000.jsonl":
        record: dict[str, object] = {"messages": [{"role": r, "content": c} for r, c in turns]}
    elif file == "part-001.jsonl.gz":
        record = {"conversations": [{"from": SHAREGPT_ROLES[r], "value": c} for r, c in turns]}
    elif turns[0][0] == "system":
        record = {"instruction": turns[0][1], "input": turns[1][1], "output": turns[2][1]}
    else:
        record = {"instruction": turns[0][1], "input": "", "output": turns[1][1]}
        if rng.random() < 0.5:
            del record["input"]
    return json.dumps(record, ensure_ascii=False)


def _replace_turn(turns: Turns, role: str, content: str) -> Turns:
    return [(r, content if r == role else c) for r, c in turns]


def _needs_normalizing(rng: random.Random, turns: Turns, kind: int) -> Turns:
    """A kept row with dirt that cleaning removes: NBSP, a control character, trailing whitespace."""
    request = dict(turns)["user"]
    spaces = [i for i, ch in enumerate(request) if ch == " "]
    at = rng.choice(spaces)
    if kind == 0:
        return _replace_turn(turns, "user", request[:at] + "\u00a0" + request[at + 1 :])
    if kind == 1:
        return _replace_turn(turns, "user", request[:at] + rng.choice(CONTROL_CHARS) + request[at:])
    if kind == 2:
        return _replace_turn(turns, "user", request + rng.choice(["  ", "\t", " \n"]))
    return _replace_turn(turns, "assistant", dict(turns)["assistant"] + rng.choice([" ", "\n"]))


def _exact_duplicate_turns(turns: Turns, kind: int) -> Turns:
    """The same conversation with the request lower-cased (kind 1) or its spaces doubled (kind 2)."""
    request = dict(turns)["user"]
    if kind == 1:
        return _replace_turn(turns, "user", request.lower())
    return _replace_turn(turns, "user", request.replace(" ", "  "))


def _near_duplicate_turns(rng: random.Random, turns: Turns) -> Turns:
    request = dict(turns)["user"]
    if rng.random() < 0.5:
        return _replace_turn(turns, "user", f"{request} {rng.choice(NEAR_DUP_APPENDS)}")
    return _replace_turn(turns, "user", f"{rng.choice(NEAR_DUP_PREPENDS)} {request}")


def _wrong_roles(example: ToolCallExample, kind: int) -> Turns:
    if kind == 0:
        return [("assistant", example.target), ("user", example.request)]
    if kind == 1:
        return [("system", SYSTEM_PROMPT), ("user", example.request), ("user", example.request)]
    return [("system", SYSTEM_PROMPT), ("user", example.request), ("bot2", example.target)]


def _malformed(rng: random.Random, file: str, example: ToolCallExample, kind: int) -> str:
    if kind == 0:
        line = _line(file, _turns(example), rng)
        return line[: len(line) // 2]  # a writer killed mid-line
    if kind == 1:
        return json.dumps([example.request, example.target])
    if kind == 2:
        return str(rng.randint(0, 999))
    if kind == 3:
        return repr({"messages": [{"role": r, "content": c} for r, c in _turns(example)]})  # Python repr
    return "<<<<<<< HEAD"


def write_sample(out_dir: str | Path, n: int = N_EXAMPLES, seed: int = SEED) -> dict[str, int]:
    """Write the three sample files with dirt into ``out_dir``; return what was written.

    Keys: the line count of each file (blank and malformed lines included), ``unique_examples``
    (= n: what survives validation, cleaning and both deduplications), ``blank_lines`` and each kind
    in ``DIRT_RATES``. The lines add up: all files together hold unique_examples + blank_lines + every
    dirt kind except needs_normalizing, which edits kept rows in place.
    """
    counts = {kind: round(rate * n) for kind, rate in DIRT_RATES.items()}
    spare_needed = counts["malformed"] + counts["wrong_roles"] + counts["empty_answers"]
    examples = generate_toolcall_rows(n + spare_needed, seed)
    good, spare = examples[:n], iter(examples[n:])  # spares feed rows that validation drops
    rng = random.Random(f"{seed}-dirt")  # own stream: the clean examples do not depend on the dirt

    sizes = [round(share * n) for share in FORMAT_SHARES[:-1]]
    home = [file for file, size in zip(FILES, [*sizes, n - sum(sizes)]) for _ in range(size)]
    turns = [_turns(ex, with_system=home[i] != FILES[2] or rng.random() < 0.5) for i, ex in enumerate(good)]

    # Disjoint good rows for each role: near-duplicates come from long requests, the rest from short.
    short_rows = [i for i in range(n) if i % LONG_EVERY != 0]
    near_sources = rng.sample(range(0, n, LONG_EVERY), counts["near_duplicates"])
    picked = rng.sample(short_rows, counts["exact_duplicates"] + counts["needs_normalizing"])
    exact_sources, dirty_rows = picked[: counts["exact_duplicates"]], picked[counts["exact_duplicates"] :]
    for k, i in enumerate(dirty_rows):
        turns[i] = _needs_normalizing(rng, turns[i], k % 4)
    good_lines = [_line(home[i], turns[i], rng) for i in range(n)]

    extra: dict[str, list[str]] = {file: list(BLANK_LINES.get(file, [])) for file in FILES}
    for k, i in enumerate(exact_sources):
        if k % 4 == 0:
            extra[home[i]].append(good_lines[i])
        elif k % 4 == 3:
            other = FILES[(FILES.index(home[i]) + 1) % len(FILES)]
            extra[other].append(_line(other, turns[i], rng))
        else:
            extra[home[i]].append(_line(home[i], _exact_duplicate_turns(turns[i], k % 4), rng))
    for i in near_sources:
        extra[home[i]].append(_line(home[i], _near_duplicate_turns(rng, turns[i]), rng))
    for k in range(counts["malformed"]):
        file = FILES[k % len(FILES)]
        extra[file].append(_malformed(rng, file, next(spare), k % 5))
    for k in range(counts["wrong_roles"]):
        file = FILES[k % 2]  # alpaca has no roles to get wrong
        extra[file].append(_line(file, _wrong_roles(next(spare), k % 3), rng))
    for k in range(counts["empty_answers"]):
        file = FILES[k % len(FILES)]
        empty = _replace_turn(_turns(next(spare)), "assistant", ["", "   ", "\n"][k % 3])
        extra[file].append(_line(file, empty, rng))

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for file in FILES:
        own = [good_lines[i] for i in range(n) if home[i] == file]
        rest = own[1:] + extra[file]
        rng.shuffle(rest)
        lines = [own[0], *rest]  # a good row first: a reader that keeps the BOM loses it, visibly
        written[file] = len(lines)
        if file == "part-000.jsonl":
            (out_dir / file).write_bytes(("\ufeff" + "\n".join(lines) + "\n").encode())
        elif file == "part-001.jsonl.gz":
            (out_dir / file).write_bytes(gzip.compress(("\n".join(lines) + "\n").encode(), mtime=0))
        else:
            (out_dir / file).write_bytes(("\r\n".join(lines) + "\r\n").encode())
    blank_lines = sum(len(blanks) for blanks in BLANK_LINES.values())
    return {**written, "unique_examples": n, "blank_lines": blank_lines, **counts}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Regenerate the shipped tool-call sample (same bytes).")
    parser.add_argument("out_dir", type=Path, help=f"folder to write {', '.join(FILES)} into")
    args = parser.parse_args(argv)
    print(json.dumps(write_sample(args.out_dir), indent=2))


if __name__ == "__main__":
    main()
