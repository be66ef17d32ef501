"""Seeded synthetic MiniMax-M2 conversations for training and evaluating `tiny-chat` (issue 6).

Every example is an OpenAI-style chat (``messages`` + ``tools``) rendered by the repository's own
chat template (src/m2serve/checkpoints/tiny-chat/chat_template.jinja) under the rendering rule of spec
docs/parsers.md §2. Four kinds, kept short so an example fits in a few hundred tokens:

- ``tool_call``: 1–3 tools drawn from a pool of ~20 schemas (string, integer, number, boolean, enum,
  array and object parameters, some optional); the user request states the argument values; the
  assistant reasons briefly (``<think>``…``</think>``) and makes one or two calls whose values are
  copied or derived (an hour and minute from "7:45", a boolean from "urgent") from the request. The
  reasoning names the needed tool and whether it is offered (verdict_reasoning).
- ``tool_result``: the same, followed by the tool response(s) ``{"result": "..."}`` and a short final
  answer that contains each tool's result value verbatim.
- ``natural_result``: the same with tool responses in the shapes real tools return (natural_result):
  a JSON object of several fields, an object with a nested object or list, a top-level list, or a
  plain string; serialised as ``json.dumps`` does, compactly, or as Python's ``str(dict)`` (what the
  OpenAI Agents SDK sends for a function tool returning a dict). The answer restates the content
  (natural_answer), so it carries every value.
- ``no_tool``: tools are offered but none fits (greeting, copying, arithmetic, or a request for a tool
  that is not offered); the assistant answers directly without a call.
- ``plain``: no tools; greetings, "repeat after me: …" copying, small arithmetic (one-digit operands).
- ``repeat``: "repeat after me" with made-up words, digit strings and codes (pure copying drills: they
  teach the induction/copy mechanism that every argument and result value needs).

**Held-out split.** Every free-form value (a city, a name, a number, a date, a list item, a result
value) belongs to exactly one split by a stable hash: ``crc32(str(value)) % 5 == 0`` is "eval",
anything else "train". The train split draws only train values and the eval split only eval values,
so no argument or result value of the eval split ever occurs as a value in training. Enums,
booleans and the one-digit operands of arithmetic turns are finite and shared by both splits;
values derived from a held-out value (the hour and minute of a held-out time) are held out as a
pair, not one by one.

Usage: ``make_examples(split="train", n=1000, seed=0)`` -> list[Example]; the same (split, n, seed)
always gives the same list.
"""

from __future__ import annotations

import functools
import json
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_PATH = Path(__file__).resolve().parents[2] / "src/m2serve/checkpoints/tiny-chat/chat_template.jinja"

KINDS = ("tool_call", "tool_result", "no_tool", "plain", "repeat", "natural_result")
# Kind mix of the training corpus (five weights leave natural_result out). The default stays the
# committed checkpoint's mix, so the documented commands of train.py and tokenizer.py reproduce it; a
# natural_result run passes six weights.
KIND_WEIGHTS = (0.36, 0.28, 0.12, 0.08, 0.16)


# ---------------------------------------------------------------------------------------------
# Rendering (docs/parsers.md §2, "Rendering rule")
# ---------------------------------------------------------------------------------------------

def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(msg):
    raise jinja2.exceptions.TemplateError(msg)


@functools.cache
def load_template(path: Path = TEMPLATE_PATH) -> jinja2.Template:
    """The chat template in a transformers-compatible sandbox (docs/parsers.md §2); read and
    compiled once per path (train.py's drill batches ask for it every step)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    return env.from_string(Path(path).read_text())


def render(template: jinja2.Template, messages: list[dict], tools: list[dict] | None,
           add_generation_prompt: bool) -> str:
    """Rendered prompt text (starts with ``]~!b[``)."""
    return template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                           bos_token="]~!b[", eos_token="[e~[", unk_token="]!d~[")


# ---------------------------------------------------------------------------------------------
# Value pools and the held-out split
# ---------------------------------------------------------------------------------------------

def is_eval_value(value) -> bool:
    """True if ``value`` belongs to the held-out eval split (stable across runs and machines)."""
    return zlib.crc32(str(value).encode()) % 5 == 0


CITIES = ("Paris London Tokyo Berlin Madrid Rome Vienna Prague Oslo Lisbon Dublin Athens Cairo Lagos "
          "Nairobi Lima Quito Bogota Santiago Havana Toronto Boston Denver Austin Chicago Seattle Miami "
          "Dallas Phoenix Houston Atlanta Detroit Sydney Perth Auckland Mumbai Delhi Dhaka Karachi Seoul "
          "Beijing Shanghai Manila Jakarta Hanoi Bangkok Taipei Osaka Kyoto Istanbul Ankara Tehran Riyadh "
          "Dubai Doha Moscow Warsaw Budapest Zurich Geneva Munich Hamburg Milan Naples Venice Florence "
          "Porto Seville Valencia Lyon Marseille Nice Brussels Amsterdam Rotterdam Copenhagen Stockholm "
          "Helsinki Reykjavik Edinburgh Glasgow Manchester Liverpool Bristol Cardiff Belfast Montreal "
          "Vancouver Calgary Ottawa Portland Tucson Omaha Memphis Nashville Orlando Tampa Honolulu "
          "Anchorage Havana Kingston Caracas Montevideo Asuncion Salvador Recife Manaus Accra Dakar Tunis "
          "Algiers Rabat Casablanca Kampala Kigali Harare Lusaka Luanda Durban Pretoria").split()
FIRST_NAMES = ("Alice Bob Carol David Emma Frank Grace Henry Irene Jack Karen Leo Mia Noah Olivia Paul "
               "Quinn Rosa Sam Tina Uma Victor Wendy Xavier Yara Zoe Aaron Bella Caleb Diana Ethan Fiona "
               "George Hannah Isaac Julia Kevin Laura Mason Nina Oscar Priya Ravi Sofia Tom Ursula Vera "
               "Will Ximena Yusuf Zack Amir Chen Dmitri Elena Farah Hugo Ines Jonas Kenji Lucia Marco "
               "Nadia Omar Pablo Rita Sven Tariq Ana Ben Cleo Dev Eli Finn Gus Ivy Jay Kai Liv Max Ned"
               ).split()
SURNAMES = ("Smith Jones Brown Garcia Miller Davis Lopez Wilson Moore Taylor Clark Lewis Walker Hall Young "
            "King Wright Scott Green Baker Adams Nelson Hill Rivera Campbell Mitchell Carter Roberts Kim "
            "Nguyen Patel Sato Muller Rossi Novak Silva Costa Haddad Okafor Ivanov").split()
SYLLABLES = ("ka lo mi ra ne to sa vi du pe zo la ri mo ta ke shi ba fu no ga te ru yo na ve li do ha "
             "sen tor ban mal kin dar vel mor lin tas ren gor").split()
NOUNS = ("report budget meeting invoice party lunch trip garden project picnic concert dinner game launch "
         "review update contract schedule demo class workshop interview payment order visit").split()
ADJS = ("weekly final quick team monthly annual new short early late big small summer winter urgent "
        "draft spring private public local").split()
TOPICS = ("cheap flights|vegan recipes|best hiking trails|python tutorials|jazz concerts|electric cars|"
          "chess openings|solar panels|used bikes|coffee shops|museum hours|train tickets|yoga classes|"
          "cat food|rain boots|board games|guitar lessons|pizza places|running shoes|book clubs|"
          "tax forms|dog parks|ski resorts|camping gear|wine bars").split("|")
DISHES = ("pizza|sushi|tacos|ramen|curry|salad|burger|pasta|dumplings|falafel|pho|paella|noodles|"
          "soup|sandwich|burrito|risotto|kebab|pancakes|waffles").split("|")
ARTISTS = ("Miles Davis|Taylor Swift|Bob Marley|Adele|Daft Punk|Nina Simone|Queen|Radiohead|Bach|Mozart|"
           "Coldplay|Beyonce|Prince|Bjork|Drake|Shakira|Metallica|Abba|Eminem|Sade").split("|")
PHRASES = ("good morning|see you soon|the sky is blue|I like green tea|open the window|cats sleep a lot|"
           "we meet at noon|the train is late|bring an umbrella|music makes me happy|keep it simple|"
           "the door is open|time flies fast|red apples taste sweet|call me later|the moon is bright|"
           "rivers flow north|my name is Sam|pack light|dance in the rain").split("|")
FOODS_TODO = ("milk eggs bread butter apples rice beans coffee tea cheese soap paper pens batteries "
              "tomatoes onions lemons flour sugar yogurt").split()
GREETINGS = (("Hello!", "Hello! How can I help you today?"),
             ("Hi there", "Hi! What can I do for you?"),
             ("Good morning!", "Good morning! How can I help?"),
             ("Thanks!", "You're welcome!"),
             ("Thank you so much", "You're welcome! Happy to help."),
             ("How are you?", "I'm doing well, thanks for asking. How can I help?"),
             ("Who are you?", "I am a helpful assistant."),
             ("Bye", "Goodbye! Have a nice day."))
WEATHER = ("sunny|cloudy|rainy|windy|foggy|snowy|stormy|clear").split("|")
CURRENCIES = ("USD", "EUR", "GBP", "JPY", "CHF")
LANGUAGES = ("French", "Spanish", "German", "Italian", "Japanese")
MONTHS = ("Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec").split()


_ONSETS = ("b c d f g h j k l m n p q r s t v w x y z ch sh th ph wh br cr dr fr gr pr tr bl cl fl gl pl "
           "sl st sp sk sc sn sm sw tw qu kn wr str").split() + [""] * 4
_NUCLEI = "a e i o u y a e i o u ai ea ee ie oo ou au ei oa ue".split()
_CODAS = ("n r l s t m d g k x z ch ck ng nd nt st rt rd rs ll ss tt ff sh th mp ns").split() + [""] * 12


TEMPLATE_WORDS = ("is", "in", "at", "on", "to", "for")  # words that follow a value in the answers


def wide_word(rng: random.Random, cap: bool = False) -> str:
    """A made-up word of any letters: 1–3 random (onset, vowel, coda) syllables over the whole alphabet
    (training values whose BPE pieces cover the letter tokens, not just the SYLLABLES inventory)."""
    w = "".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)
                for _ in range(rng.randint(1, 3)))
    return w.capitalize() if cap else w


@dataclass(slots=True)
class Sampler:
    """Draws values of one split; every free-form value passes ``is_eval_value`` == (split == eval).

    ``arith``: "one_digit" (operands 0–9, shared by both splits: one_digit_sum) or "two_digit"
    (operands 0–50 of the split; how the first training phases of the committed checkpoint were made).

    ``verdict`` (default True): a tool request's reasoning names the needed tool in quotes and says
    whether it is offered (``I need "get_weather", which is offered.`` / ``I need "get_weather". It is
    not offered, ...``); see verdict_reasoning. False: the reasoning of the first training phases
    (``I will call get_weather.`` / ``..., but no offered tool can do that.``).

    ``suffix`` (training only, default 0): the probability that a made-up word ends in a word of the
    answer templates (TEMPLATE_WORDS: ``Lomoris``), so the model learns where a copied value ends when
    its last BPE piece is the template word that follows it ("The weather in Paris is ...", where
    ``Paris`` is ``P`` + ``ar`` + ``is``).

    ``natural``: the answer format of a natural result, a key of NATURAL_FORMATS (natural_answer).

    ``wide`` (training only, default 0): the probability that a made-up word or a name is a
    ``wide_word`` (any letters) instead of a syllable word or a listed name, so that the pieces of
    unseen real words (a held-out ``Munich`` is ``Mun`` + ``ich``) occur as values in training."""

    rng: random.Random
    split: str
    wide: float = 0.0
    arith: str = "one_digit"
    verdict: bool = True
    suffix: float = 0.0
    natural: str = "result_of"

    def pick(self, make: Callable[[], object], tries: int = 200):
        """Draw from ``make`` until the value belongs to this split (raises if the pool is too small)."""
        want_eval = self.split == "eval"
        for _ in range(tries):
            v = make()
            if is_eval_value(v) == want_eval:
                return v
        raise RuntimeError(f"value pool too small for split {self.split!r}")

    def choice(self, seq):
        return self.rng.choice(seq)

    def city(self) -> str:
        r = self.rng
        return self.pick(lambda: r.choice(CITIES) if r.random() < 0.4 else self.word(cap=True))

    def word(self, cap: bool = False) -> str:
        r = self.rng
        if self.wide and r.random() < self.wide:
            w = wide_word(r)
        else:
            w = "".join(r.choice(SYLLABLES) for _ in range(r.randint(2, 3)))
        if self.suffix and r.random() < self.suffix:
            w += r.choice(TEMPLATE_WORDS)
        return w.capitalize() if cap else w

    def person(self) -> str:
        r = self.rng
        if self.wide and r.random() < self.wide:
            return self.pick(lambda: wide_word(r, True) if r.random() < 0.5 else
                             f"{wide_word(r, True)} {wide_word(r, True)}")
        return self.pick(lambda: r.choice(FIRST_NAMES) if r.random() < 0.5 else
                         f"{r.choice(FIRST_NAMES)} {r.choice(SURNAMES)}")

    def email(self) -> str:
        r = self.rng
        return self.pick(lambda: f"{r.choice(FIRST_NAMES).lower()}{r.randint(1, 99)}@"
                                 f"{r.choice(('mail.com', 'work.org', 'home.net', 'corp.io'))}")

    def integer(self, lo: int, hi: int) -> int:
        return self.pick(lambda: self.rng.randint(lo, hi))

    def amount(self) -> int | float:
        r = self.rng
        return self.pick(lambda: r.randint(2, 990) if r.random() < 0.5 else
                         r.randint(2, 990) + r.choice((0.25, 0.5, 0.75)))

    def date(self) -> str:
        r = self.rng
        return self.pick(lambda: f"2026-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}")

    def clock(self) -> str:
        r = self.rng
        return self.pick(lambda: f"{r.randint(1, 12)}:{r.choice((0, 15, 30, 45, 10, 20, 40, 50)):02d}")

    def title(self) -> str:
        r = self.rng
        return self.pick(lambda: f"{r.choice(ADJS)} {r.choice(NOUNS)}")

    def topic(self) -> str:
        r = self.rng
        return self.pick(lambda: r.choice(TOPICS) if r.random() < 0.5 else
                         f"{self.word()} {r.choice(NOUNS)}s")

    def code(self, letters: int, digits: int) -> str:
        r = self.rng
        return self.pick(lambda: "".join(r.choice("ABCDEFGHJKLMNPRSTUVWXYZ") for _ in range(letters))
                         + "".join(r.choice("0123456789") for _ in range(digits)))

    def items(self) -> list[str]:
        r = self.rng
        n = r.randint(2, 3)
        out: list[str] = []
        while len(out) < n:
            v = self.pick(lambda: r.choice(FOODS_TODO) if r.random() < 0.5 else self.word())
            if v not in out:
                out.append(v)
        return out

    def phrase(self) -> str:
        r = self.rng
        return self.pick(lambda: r.choice(PHRASES) if r.random() < 0.4 else
                         " ".join(self.word() for _ in range(r.randint(2, 4))))

    def result_value(self, kind: str) -> str:
        """A tool's result value: short text that the final answer must repeat verbatim."""
        r = self.rng
        makers = {
            "weather": lambda: f"{r.choice(WEATHER)}, {r.randint(-9, 39)} C",
            "time": lambda: f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}",
            "money": lambda: f"{r.randint(1, 9999)}.{r.randint(0, 99):02d}",
            "id": lambda: self.code(2, 4),
            "status": lambda: f"{r.choice(('on time', 'delayed', 'boarding', 'landed'))} at gate "
                              f"{r.choice('ABCDE')}{r.randint(1, 40)}",
            "phone": lambda: f"555-{r.randint(1000, 9999)}",
            "text": lambda: " ".join(self.word() for _ in range(r.randint(2, 3))),
            "minutes": lambda: f"{r.randint(3, 240)} minutes",
        }
        return self.pick(makers[kind])

    def field(self, key: str) -> str | int | float:
        """A value for the result field ``key`` (NATURAL_FIELDS), of this split."""
        r = self.rng
        makers = {
            "city": self.city, "country": lambda: self.word(cap=True), "name": self.person,
            "condition": lambda: r.choice(WEATHER) if r.random() < 0.5 else self.word(),
            "temperature_c": lambda: r.randint(-9, 39), "temperature": lambda: r.randint(-9, 99),
            "humidity": lambda: r.randint(5, 100), "wind_kph": lambda: r.randint(0, 80),
            "time": self.clock, "date": self.date, "status": lambda: r.choice(
                ("confirmed", "pending", "delayed", "on time", "shipped", "sent")) if r.random() < 0.5
            else self.word(),
            "id": lambda: self.code(r.randint(1, 3), r.randint(2, 5)), "price": self.amount,
            "total": self.amount, "currency": lambda: r.choice(CURRENCIES) + self.code(0, 2),
            "count": lambda: r.randint(0, 500), "minutes": lambda: r.randint(1, 240),
            "phone": lambda: f"555-{r.randint(1000, 9999)}", "email": self.email, "title": self.title,
            "message": lambda: " ".join(self.word() for _ in range(r.randint(2, 4))),
            "gate": lambda: f"{r.choice('ABCDE')}{r.randint(1, 40)}", "text": self.phrase,
            "item": lambda: r.choice(FOODS_TODO) if r.random() < 0.5 else self.word(),
            "code": lambda: self.code(r.randint(2, 4), r.randint(0, 3)),
        }
        return self.pick(makers[key])

    def natural_result(self, weather: bool) -> tuple[object, list[str]]:
        """A tool's result in a natural shape -> (value, its leaf values as the answer writes them).

        Shapes: an object of 2–4 fields (weather-like fields when ``weather``), an object with one
        nested object or list, a top-level list of 2–3 values or of small objects, a plain string.
        Every leaf value belongs to this split; no booleans (they are shared by both splits)."""
        r = self.rng
        keys = list(WEATHER_FIELDS if weather and r.random() < 0.7 else NATURAL_FIELDS)

        def obj(n: int) -> dict:
            ks = r.sample(keys, n)
            if weather and "city" in keys and r.random() < 0.5:  # the Agents SDK example's order
                ks = ["city"] + [k for k in ks if k != "city"][: n - 1]
            return {k: self.field(k) for k in ks}

        shape = r.random()
        if shape < 0.4:
            value = obj(r.randint(2, 4))
        elif shape < 0.6:
            value = obj(r.randint(1, 2))
            key = r.choice([k for k in ("details", "info", "data", "items", "results", "location", "extra")
                            if k not in value])
            if r.random() < 0.5:
                value[key] = {k: self.field(k) for k in r.sample(NATURAL_FIELDS, 2)}
            else:
                k = r.choice(("item", "name", "city", "code", "time"))
                value[key] = list(dict.fromkeys(self.field(k) for _ in range(r.randint(2, 3))))
        elif shape < 0.8:
            if r.random() < 0.6:
                k = r.choice(("item", "name", "city", "code", "time", "message"))
                value = list(dict.fromkeys(self.field(k) for _ in range(r.randint(2, 3))))
            else:
                ks = r.sample(NATURAL_FIELDS, 2)
                value = [{k: self.field(k) for k in ks} for _ in range(2)]
        else:
            value = self.result_value(r.choice(("weather", "time", "money", "id", "status", "phone", "text",
                                                 "minutes")))
        return value, [natural_text(v) for v in leaf_values(value)]


WEATHER_FIELDS = ("city", "temperature_c", "condition", "humidity", "wind_kph", "temperature")
NATURAL_FIELDS = ("city", "country", "name", "condition", "temperature_c", "humidity", "time", "date",
                  "status", "id", "price", "total", "currency", "count", "minutes", "phone", "email",
                  "title", "message", "gate", "text", "item", "code")


def leaf_values(value) -> list:
    """The scalar leaves of a result, in order (dict values, list items, recursively)."""
    if isinstance(value, dict):
        return [x for v in value.values() for x in leaf_values(v)]
    if isinstance(value, list):
        return [x for v in value for x in leaf_values(v)]
    return [value]


def natural_text(value) -> str:
    """How a result's value is written in the answer: a string as is, a number as JSON writes it."""
    return value if isinstance(value, str) else json.dumps(value)


# Answer formats of a natural result (natural_answer). "returned" was RUN9/RUN10's (train.py); its
# "returned" also ends the reasoning's "The tool returned an object.", and the model sometimes ended
# its reasoning with the answer's end of turn, so the committed model answers "Result of NAME: ...".
NATURAL_FORMATS = {"result_of": "Result of {name}: {content}.", "returned": "{name} returned: {content}."}


def natural_answer(name: str, content: str, style: str = "result_of") -> str:
    """The answer to a natural result: ``Result of NAME: CONTENT.`` (NATURAL_FORMATS[style]) with the
    tool message's content restated as it came (JSON, compact JSON, Python ``str()`` or the plain
    string).

    A restatement, not a rephrasing: copying a span token for token is what this 4-layer model's
    induction heads do reliably (tool-call values, "repeat after me"), while rewriting an object as
    ``city Paris, temperature_c 18`` (drop the quotes and separators between copied tokens) was not
    learned in 300 fine-tuning steps (train.py, RUN8: 1/20 held out)."""
    return NATURAL_FORMATS[style].format(name=name, content=content)


def serialise_result(rng: random.Random, value) -> str:
    """A tool message's content: a string as is; otherwise ``json.dumps`` (default or compact
    separators) or Python's ``str`` (the OpenAI Agents SDK's serialisation of a returned dict)."""
    if isinstance(value, str):
        return value
    r = rng.random()
    if r < 0.45:
        return json.dumps(value, ensure_ascii=False)
    if r < 0.65:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return str(value)


# ---------------------------------------------------------------------------------------------
# Tool pool: schema + request phrasing + argument values + result
# ---------------------------------------------------------------------------------------------

S, I, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def _enum(*vals):
    return {"type": "string", "enum": list(vals)}


@dataclass(slots=True)
class Call:
    """One sampled use of a tool: request text, arguments, the reasoning clause and the result."""

    request: str
    args: dict
    think: str
    result_kind: str
    answer: str  # final-answer template with {v} for the result value


@dataclass(slots=True)
class ToolSpec:
    name: str
    description: str
    properties: dict
    required: list[str]
    sample: Callable[[Sampler], Call]
    ask: str  # "a tool to ..." phrase used when this tool is requested but not offered

    def schema(self) -> dict:
        params = {"type": "object", "properties": self.properties, "required": self.required}
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": params}}


def _weather(s: Sampler) -> Call:
    city = s.city()
    r = s.rng.random()
    if r < 0.35:
        unit = s.choice(("celsius", "fahrenheit"))
        req = s.choice((f"What's the weather in {city} in {unit}?", f"Weather for {city}, in {unit} please."))
        args = {"city": city, "unit": unit}
    else:
        req = s.choice((f"What's the weather in {city}?", f"How is the weather in {city} today?",
                        f"Is it raining in {city}?", f"Tell me the weather in {city}."))
        args = {"city": city}
    return Call(req, args, f"the weather in {city}", "weather", f"The weather in {city} is {{v}}.")


def _time(s: Sampler) -> Call:
    city = s.city()
    return Call(s.choice((f"What time is it in {city}?", f"Current time in {city}?")), {"city": city},
                f"the time in {city}", "time", f"It is {{v}} in {city}.")


def _email(s: Sampler) -> Call:
    to, subject = s.email(), s.title()
    urgent = s.rng.random() < 0.4
    req = (f"Send an {'urgent ' if urgent else ''}email to {to} with the subject \"{subject}\"."
           if s.rng.random() < 0.5 else
           f"Email {to} about \"{subject}\"{', it is urgent' if urgent else ''}.")
    return Call(req, {"to": to, "subject": subject, "urgent": urgent}, f"to email {to}", "id",
                "Done, the email was sent with id {v}.")


def _alarm(s: Sampler) -> Call:
    t = s.clock()
    h, m = (int(x) for x in t.split(":"))
    return Call(s.choice((f"Set an alarm for {t}.", f"Wake me up at {t}.")), {"hour": h, "minute": m},
                f"an alarm at hour {h} and minute {m}", "id", "Your alarm is set, id {v}.")


def _flight(s: Sampler) -> Call:
    a = s.city()
    b = s.city()
    while b == a:
        b = s.city()
    d = s.date()
    return Call(s.choice((f"Book a flight from {a} to {b} on {d}.",
                          f"I need a flight {a} to {b}, date {d}.")),
                {"origin": a, "destination": b, "date": d}, f"a flight from {a} to {b} on {d}", "id",
                "Your flight is booked, confirmation {v}.")


def _search(s: Sampler) -> Call:
    q = s.topic()
    if s.rng.random() < 0.4:
        n = s.integer(2, 20)
        return Call(f"Search the web for {q}, top {n} results.", {"query": q, "max_results": n},
                    f"to search for {q} with {n} results", "text", "The top result is {v}.")
    return Call(s.choice((f"Search the web for {q}.", f"Look up {q} online.")), {"query": q},
                f"to search for {q}", "text", "The top result is {v}.")


def _currency(s: Sampler) -> Call:
    amt = s.amount()
    a, b = s.rng.sample(CURRENCIES, 2)
    return Call(s.choice((f"Convert {amt} {a} to {b}.", f"How much is {amt} {a} in {b}?")),
                {"amount": amt, "from_currency": a, "to_currency": b}, f"to convert {amt} {a} to {b}",
                "money", f"{amt} {a} is {{v}} {b}.")


def _event(s: Sampler) -> Call:
    title, d = s.title(), s.date()
    people = []
    while len(people) < s.rng.randint(2, 3):
        p = s.person()
        if p not in people:
            people.append(p)
    who = ", ".join(people[:-1]) + " and " + people[-1]
    return Call(f"Create an event \"{title}\" on {d} with {who}.",
                {"title": title, "date": d, "attendees": people}, f"an event on {d} for {who}", "id",
                "The event is created with id {v}.")


def _translate(s: Sampler) -> Call:
    text, lang = s.phrase(), s.choice(LANGUAGES)
    return Call(s.choice((f"Translate \"{text}\" into {lang}.", f"How do you say \"{text}\" in {lang}?")),
                {"text": text, "target_language": lang}, f"to translate \"{text}\" into {lang}", "text",
                f"In {lang} that is: {{v}}.")


def _stock(s: Sampler) -> Call:
    sym = s.code(s.rng.randint(3, 4), 0)
    return Call(s.choice((f"What is the stock price of {sym}?", f"Quote {sym} for me.")), {"symbol": sym},
                f"the price of {sym}", "money", f"{sym} trades at {{v}} USD.")


def _music(s: Sampler) -> Call:
    artist = s.pick(lambda: s.choice(ARTISTS) if s.rng.random() < 0.5 else s.person())
    shuffle = s.rng.random() < 0.5
    return Call(f"Play some {artist}{' on shuffle' if shuffle else ''}.",
                {"artist": artist, "shuffle": shuffle}, f"to play {artist}", "text", "Now playing: {v}.")


def _thermostat(s: Sampler) -> Call:
    t = s.pick(lambda: s.rng.randint(15, 28) + s.choice((0, 0.5)))
    room = s.pick(lambda: s.choice(("kitchen", "bedroom", "office", "hall")) + " " + str(s.rng.randint(1, 9)))
    if s.rng.random() < 0.5:
        return Call(f"Set the thermostat in the {room} to {t} degrees.", {"temperature": t, "room": room},
                    f"to set {room} to {t} degrees", "id", "The thermostat is set, id {v}.")
    return Call(f"Set the thermostat to {t} degrees.", {"temperature": t}, f"to set the thermostat to {t}",
                "id", "The thermostat is set, id {v}.")


def _food(s: Sampler) -> Call:
    dish = s.pick(lambda: s.choice(DISHES) if s.rng.random() < 0.5 else f"{s.word()} {s.choice(DISHES)}")
    n = s.integer(1, 12)
    return Call(s.choice((f"Order {n} {dish} for delivery.", f"I want {n} portions of {dish}.")),
                {"dish": dish, "quantity": n}, f"to order {n} {dish}", "minutes",
                "Your order will arrive in {v}.")


def _contact(s: Sampler) -> Call:
    name = s.person()
    return Call(s.choice((f"What is the phone number of {name}?", f"Find the contact for {name}.")),
                {"name": name}, f"the contact of {name}", "phone", f"The number of {name} is {{v}}.")


def _user(s: Sampler) -> Call:
    name, age = s.person(), s.integer(18, 90)
    return Call(s.choice((f"Create a user named {name}, age {age}.", f"Add a new user {name} who is {age}.")),
                {"profile": {"name": name, "age": age}}, f"a user {name} aged {age}", "id",
                "The user was created with id {v}.")


def _tip(s: Sampler) -> Call:
    bill, pct = s.amount(), s.integer(5, 30)
    return Call(s.choice((f"What is a {pct} percent tip on {bill}?",
                          f"Calculate a {pct}% tip for a bill of {bill}.")),
                {"bill": bill, "percent": pct}, f"a {pct} percent tip on {bill}", "money", "The tip is {v}.")


def _directions(s: Sampler) -> Call:
    a = s.city()
    b = s.city()
    while b == a:
        b = s.city()
    mode = s.choice(("driving", "walking", "transit"))
    verb = {"driving": "drive", "walking": "walk", "transit": "take transit"}[mode]
    return Call(f"How do I {verb} from {a} to {b}?", {"start": a, "end": b, "mode": mode},
                f"{mode} directions from {a} to {b}", "minutes", f"The trip from {a} to {b} takes {{v}}.")


def _todo(s: Sampler) -> Call:
    items, prio = s.items(), s.choice(("low", "medium", "high"))
    what = ", ".join(items[:-1]) + " and " + items[-1]
    return Call(f"Add {what} to my todo list with {prio} priority.", {"items": items, "priority": prio},
                f"to add {what} with {prio} priority", "id", "Added to your list, id {v}.")


def _flight_status(s: Sampler) -> Call:
    fn = s.code(2, s.rng.randint(2, 4))
    return Call(s.choice((f"Is flight {fn} on time?", f"Status of flight {fn}?")), {"flight_number": fn},
                f"the status of flight {fn}", "status", f"Flight {fn} is {{v}}.")


def _table(s: Sampler) -> Call:
    rest = s.pick(lambda: f"{s.word(cap=True)} {s.choice(('Bistro', 'Cafe', 'Grill', 'House', 'Kitchen'))}")
    n, t = s.integer(1, 12), s.clock()
    return Call(f"Reserve a table at {rest} for {n} people at {t}.",
                {"restaurant": rest, "people": n, "time": t},
                f"a table at {rest} for {n} at {t}", "id", "Your table is reserved, code {v}.")


TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec("get_weather", "Get the weather for a city", {"city": S, "unit": _enum("celsius", "fahrenheit")},
             ["city"], _weather, "check the weather"),
    ToolSpec("get_time", "Get the local time in a city", {"city": S}, ["city"], _time, "tell the time"),
    ToolSpec("send_email", "Send an email", {"to": S, "subject": S, "urgent": B}, ["to", "subject"], _email,
             "send emails"),
    ToolSpec("set_alarm", "Set an alarm", {"hour": I, "minute": I}, ["hour", "minute"], _alarm, "set alarms"),
    ToolSpec("book_flight", "Book a flight", {"origin": S, "destination": S, "date": S},
             ["origin", "destination", "date"], _flight, "book flights"),
    ToolSpec("search_web", "Search the web", {"query": S, "max_results": I}, ["query"], _search,
             "search the web"),
    ToolSpec("convert_currency", "Convert money", {"amount": N, "from_currency": _enum(*CURRENCIES),
                                                    "to_currency": _enum(*CURRENCIES)},
             ["amount", "from_currency", "to_currency"], _currency, "convert currencies"),
    ToolSpec("create_event", "Create a calendar event", {"title": S, "date": S, "attendees": {
        "type": "array", "items": S}}, ["title", "date", "attendees"], _event, "create events"),
    ToolSpec("translate", "Translate text", {"text": S, "target_language": _enum(*LANGUAGES)},
             ["text", "target_language"], _translate, "translate text"),
    ToolSpec("get_stock_price", "Get a stock price", {"symbol": S}, ["symbol"], _stock,
             "look up stock prices"),
    ToolSpec("play_music", "Play music", {"artist": S, "shuffle": B}, ["artist"], _music, "play music"),
    ToolSpec("set_thermostat", "Set the thermostat", {"temperature": N, "room": S}, ["temperature"],
             _thermostat,
             "control the thermostat"),
    ToolSpec("order_food", "Order food delivery", {"dish": S, "quantity": I}, ["dish", "quantity"], _food,
             "order food"),
    ToolSpec("lookup_contact", "Find a phone number", {"name": S}, ["name"], _contact, "look up contacts"),
    ToolSpec("create_user", "Create a user",
             {"profile": {"type": "object", "properties": {"name": S, "age": I}}},
             ["profile"], _user, "create users"),
    ToolSpec("calculate_tip", "Calculate a tip", {"bill": N, "percent": I}, ["bill", "percent"], _tip,
             "calculate tips"),
    ToolSpec("get_directions", "Get directions", {"start": S, "end": S, "mode": _enum("driving", "walking",
                                                                                       "transit")},
             ["start", "end", "mode"], _directions, "give directions"),
    ToolSpec("add_todo", "Add items to a todo list", {"items": {"type": "array", "items": S},
                                                      "priority": _enum("low", "medium", "high")},
             ["items", "priority"], _todo, "manage todo lists"),
    ToolSpec("flight_status", "Check a flight status", {"flight_number": S}, ["flight_number"],
             _flight_status,
             "check flights"),
    ToolSpec("reserve_table", "Reserve a restaurant table", {"restaurant": S, "people": I, "time": S},
             ["restaurant", "people", "time"], _table, "reserve tables"),
)
TOOLS_BY_NAME = {t.name: t for t in TOOLS}


# ---------------------------------------------------------------------------------------------
# Examples
# ---------------------------------------------------------------------------------------------

@dataclass(slots=True)
class Example:
    """One conversation.

    ``messages`` is the whole chat; the assistant turns after the last user message are the training
    targets. ``prompt_messages`` is the eval prompt (everything before the final assistant turn).
    ``calls`` are the expected calls of the ``tool_call`` kind as (name, arguments);
    ``result_values`` are the values the final answer of a ``tool_result`` example must contain.
    """

    kind: str
    tools: list[dict] | None
    messages: list[dict]
    calls: list[tuple[str, dict]] = field(default_factory=list)
    result_values: list[str] = field(default_factory=list)

    @property
    def prompt_messages(self) -> list[dict]:
        return self.messages[:-1]


def _tool_count(r: random.Random) -> int:
    """How many tools a tool-kind request offers: 1–3, mostly one (shorter prompts)."""
    return r.choices((1, 2, 3), weights=(0.5, 0.3, 0.2))[0]


def verdict_reasoning(wants: str, names: list[str], offered: bool) -> str:
    """Reasoning of a tool request in the ``verdict`` format: ``The user wants {wants}. I need "NAME"``
    then ``", which is offered.`` (one tool; ``", and "B", both offered.`` for two) or ``". It is not
    offered, so I cannot call it.``.

    Why: the token after the quoted name decides between calling and answering directly. When the tool is
    offered, the system prompt's schema holds the same tokens (``"name": "get_weather", ...``), so that
    token (``",``) is what an induction head copies from it; when it is not offered there is nothing to
    copy. The model thereby reads the tool list with the copy mechanism it already has (before this
    format it called requested tools that were not offered: 0/32 held-out no-calls)."""
    quoted = " and ".join(f'"{n}",' for n in names)
    if not offered:
        return f'The user wants {wants}. I need "{names[0]}". It is not offered, so I cannot call it.'
    return f"The user wants {wants}. I need {quoted} " + ("which is offered." if len(names) == 1 else
                                                            "both offered.")


def verdict_prompt(s: Sampler, tpl: jinja2.Template) -> tuple[str, str, str]:
    """A verdict drill (train.py --verdict-rows): one tool request rendered twice, with its tool offered
    and with another in its place (1–3 tools, same shuffle otherwise) -> (offered text, not-offered text,
    ``name``): each text is the rendered prompt plus ``The user wants ... I need "NAME``, so the next
    token is the verdict (``", `` or ``". ``, verdict_reasoning)."""
    r = s.rng
    need = r.choice(TOOLS)
    call = need.sample(s)
    k = _tool_count(r)
    others = r.sample([t for t in TOOLS if t is not need], k - 1)
    other = r.choice([t for t in TOOLS if t is not need and t not in others])
    pos = r.randrange(k)
    full = verdict_reasoning(call.think, [need.name], True)
    head = full[: full.index(f'"{need.name}"') + 1 + len(need.name)]  # up to the verdict token
    user = [{"role": "user", "content": call.request}]
    texts = [render(tpl, user, [t.schema() for t in others[:pos] + [t] + others[pos:]], True) + head
             for t in (need, other)]
    return texts[0], texts[1], need.name


def _assistant_calls(calls: list[tuple[str, dict]], thinks: list[str], idx: int, verdict: bool) -> dict:
    names = list(dict.fromkeys(n for n, _ in calls))
    reasoning = verdict_reasoning(" and ".join(thinks), names, True) if verdict else \
        "The user wants " + " and ".join(thinks) + ". I will call " + " and ".join(names) + "."
    return {"role": "assistant", "content": "", "reasoning_content": reasoning,
            "tool_calls": [{"id": f"call_{idx}_{i}", "type": "function",
                            "function": {"name": n, "arguments": a}} for i, (n, a) in enumerate(calls)]}


def _direct_turn(s: Sampler) -> tuple[str, str, str]:
    """(user text, reasoning, answer) for a turn that needs no tool."""
    r = s.rng.random()
    if r < 0.3:
        u, a = s.choice(GREETINGS)
        return u, "The user is chatting. No tool is needed.", a
    if r < 0.65:
        p = s.phrase()
        return (s.choice((f"Repeat after me: {p}", f"Say exactly this: {p}")),
                "The user wants me to repeat a phrase. No tool is needed.", p)
    if s.arith == "two_digit":  # the committed checkpoint's first phases (train.py docstring)
        a, b = s.integer(0, 50), s.integer(0, 50)
        op = s.choice(("plus", "minus")) if a >= b else "plus"
        val = a + b if op == "plus" else a - b
    else:
        a, op, b, val = one_digit_sum(s.rng)
    return arith_turn(a, op, b, val)


def arith_turn(a: int, op: str, b: int, val: int) -> tuple[str, str, str]:
    """(user text, reasoning, answer) of an arithmetic turn: "What is 7 plus 5?" -> "7 plus 5 is 12."."""
    return f"What is {a} {op} {b}?", f"{a} {op} {b} is {val}. No tool is needed.", f"{a} {op} {b} is {val}."


def one_digit_sum(rng: random.Random) -> tuple[int, str, int, int]:
    """(a, "plus" | "minus", b, value) with one-digit operands (minus only when a >= b). One-digit
    operands are a finite set shared by both splits, like enums: the 155 facts can be learned, while
    sums of held-out two-digit operands cannot be by a model this small (it memorises a number's digits
    instead of reading them: column arithmetic reached 99% on training operands and 0% on held-out ones)."""
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    op = rng.choice(("plus", "minus")) if a >= b else "plus"
    return a, op, b, a + b if op == "plus" else a - b


TWO_CALL_RATE = 0.25  # share of tool_call / tool_result requests asking for two calls (the eval split's)


def make_example(s: Sampler, kind: str, idx: int, two_call_rate: float = TWO_CALL_RATE,
                 bare_calls: float = 0.0) -> Example:
    """One example of ``kind`` drawn with the sampler ``s`` (its rng, split and arithmetic style); a
    tool request asks for two calls with probability ``two_call_rate``. With probability ``bare_calls``
    the call turn of a ``tool_result`` / ``natural_result`` example has no ``reasoning_content``, as API
    clients send the history back (the OpenAI Agents SDK's chat completions model does); train.py
    takes no loss on such a turn (encode_example), so the model still learns to reason before a call."""
    r = s.rng
    if kind == "repeat":
        makers = (lambda: " ".join(s.word() for _ in range(r.randint(1, 5))),
                  lambda: " ".join(str(r.randint(0, 99999)) for _ in range(r.randint(1, 3))),
                  lambda: " ".join(s.word(cap=True) + " " + str(r.randint(1, 999))
                                   for _ in range(r.randint(1, 2))),
                  lambda: "-".join(s.code(r.randint(1, 3), r.randint(1, 4)) for _ in range(r.randint(1, 2))))
        p = s.pick(r.choice(makers))
        u = s.choice((f"Repeat after me: {p}", f"Say exactly this: {p}"))
        return Example(kind, None, [{"role": "user", "content": u}, {
            "role": "assistant", "content": p,
            "reasoning_content": "The user wants me to repeat a phrase. No tool is needed."}])
    if kind == "plain":
        u, think, a = _direct_turn(s)
        return Example(kind, None, [{"role": "user", "content": u},
                                    {"role": "assistant", "content": a, "reasoning_content": think}])
    n_tools = _tool_count(r)
    offered = r.sample(TOOLS, n_tools)
    tools = [t.schema() for t in offered]
    if kind == "no_tool":
        if r.random() < 0.5:
            absent = r.choice([t for t in TOOLS if t not in offered])
            call = absent.sample(s)
            u = call.request
            think = verdict_reasoning(call.think, [absent.name], False) if s.verdict else \
                f"The user wants {call.think}, but no offered tool can do that."
            a = f"Sorry, I cannot {absent.ask} with the tools I have."
        else:
            u, think, a = _direct_turn(s)
        return Example(kind, tools, [{"role": "user", "content": u},
                                     {"role": "assistant", "content": a, "reasoning_content": think}])
    # tool_call / tool_result: one call, or two (same tool twice or two offered tools)
    first = r.choice(offered)
    picks = [first]
    if r.random() < two_call_rate:
        picks.append(r.choice(offered))
    sampled = [t.sample(s) for t in picks]
    if len(sampled) == 2 and sampled[0].args == sampled[1].args:
        sampled, picks = sampled[:1], picks[:1]
    user = " ".join(c.request for c in sampled) if len(sampled) == 1 else \
        sampled[0].request + " Also, " + sampled[1].request[0].lower() + sampled[1].request[1:]
    calls = [(t.name, c.args) for t, c in zip(picks, sampled)]
    msgs = [{"role": "user", "content": user},
            _assistant_calls(calls, [c.think for c in sampled], idx, s.verdict)]
    if kind == "tool_call":
        return Example(kind, tools, msgs, calls=calls)
    if bare_calls and r.random() < bare_calls:  # no draw at 0: the earlier corpora stay the same
        del msgs[1]["reasoning_content"]
    if kind == "natural_result":
        results = [s.natural_result(t.name == "get_weather") for t in picks]
        contents = [serialise_result(r, v) for v, _ in results]
        for i, c in enumerate(contents):
            msgs.append({"role": "tool", "tool_call_id": f"call_{idx}_{i}", "content": c})
        answer = " ".join(natural_answer(t.name, c, s.natural) for t, c in zip(picks, contents))
        think = "The tool returned " + " and ".join(
            "a text" if isinstance(v, str) else "a list" if isinstance(v, list) else "an object"
            for v, _ in results) + "."
        msgs.append({"role": "assistant", "content": answer, "reasoning_content": think})
        return Example(kind, tools, msgs, result_values=[x for _, leaves in results for x in leaves])
    values = [s.result_value(c.result_kind) for c in sampled]
    for i, v in enumerate(values):
        msgs.append({"role": "tool", "tool_call_id": f"call_{idx}_{i}", "content": json.dumps({"result": v})})
    answer = " ".join(c.answer.format(v=v) for c, v in zip(sampled, values))
    think = "The tool returned " + " and ".join(values) + "."
    msgs.append({"role": "assistant", "content": answer, "reasoning_content": think})
    return Example(kind, tools, msgs, result_values=values)


def make_examples(split: str, n: int, seed: int, weights: tuple[float, ...] = KIND_WEIGHTS,
                  two_call_rate: float = TWO_CALL_RATE, wide: float = 0.0, arith: str = "one_digit",
                  verdict: bool = True, suffix: float = 0.0, bare_calls: float = 0.0,
                  natural: str = "result_of") -> list[Example]:
    """``n`` examples of ``split`` ("train" or "eval"), kinds mixed by ``weights`` (one per KINDS
    entry), two-call requests at ``two_call_rate``, ``wide``, ``arith``, ``verdict``, ``suffix`` and
    ``natural`` as in Sampler, ``bare_calls`` as in make_example; deterministic.

    Five weights (the documented runs before natural_result) give natural_result weight 0, which
    draws the same corpus as before that kind existed.

    Raises ValueError for an unknown split, or ``weights`` not one per KINDS entry (or one fewer)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if len(weights) == len(KINDS) - 1:
        weights = (*weights, 0.0)
    if len(weights) != len(KINDS):
        raise ValueError(f"weights: need one per kind {KINDS}, got {len(weights)}")
    rng = random.Random(f"{split}:{seed}")
    s = Sampler(rng, split, wide, arith, verdict, suffix, natural)
    kinds = rng.choices(KINDS, weights=weights, k=n)
    return [make_example(s, k, i, two_call_rate, bare_calls) for i, k in enumerate(kinds)]


def eval_subset(kind: str, n: int, seed: int = 1234) -> list[Example]:
    """The first ``n`` eval examples of one kind (fixed: the test's 50-example subsets come from here)."""
    rng = random.Random(f"eval-{kind}:{seed}")
    s = Sampler(rng, "eval")
    return [make_example(s, kind, i) for i in range(n)]


def drill_text(rng: random.Random, wide: float = 0.0) -> str:
    """A copy drill (train split only): 3–8 random values of the kinds the tools take (made-up and real
    words, names, numbers, codes, dates, times), space-separated. train.py --drill-rows feeds
    ``text + "\n" + text`` with the loss on the second copy: dense practice for the induction/copy
    mechanism that argument and result values need."""
    s = Sampler(rng, "train", wide)
    makers = (lambda: s.word(cap=rng.random() < 0.5), s.city, s.person, lambda: str(s.integer(0, 9999)),
              lambda: s.code(rng.randint(1, 3), rng.randint(1, 4)), s.date, s.clock, lambda: str(s.amount()),
              lambda: s.choice(FOODS_TODO), s.phrase)
    return " ".join(rng.choice(makers)() for _ in range(rng.randint(3, 8)))


def result_drill(rng: random.Random, wide: float = 0.0, twins: bool = True, natural: str = "result_of"
                 ) -> tuple[str, int, str]:
    """A tool-result copy drill (train split only) -> (text, start, content): distractors, then
    ``<response>CONTENT</response>`` and the answer ``Result of NAME: CONTENT.`` (natural_answer,
    ``natural`` as there); train.py --result-rows takes the loss from character ``start`` on (the
    restated content and its full stop). The distractors share
    tokens (``{"``, keys, ``": ``) with the content, as a real prompt's tool schemas do: the drill
    trains copying from the latest response rather than from any earlier match (natural_answer).

    Distractors: with ``twins``, 1–4 of JSON schemas over result field names, other results, and
    (most often) twins of the content: the same keys, shape and serialisation with other values;
    without (train.py RUN10's drills), 1–3 schemas or other results. A twin's values are drawn without
    the split filter (some are held-out values): they are context, never a target."""
    s = Sampler(rng, "train", wide)

    def schema() -> str:
        keys = rng.sample(NATURAL_FIELDS, rng.randint(1, 3))
        props = {k: {"type": rng.choice(("string", "integer", "number"))} for k in keys}
        return json.dumps({"type": "object", "properties": props})

    if not twins:
        def response() -> str:
            value = s.natural_result(rng.random() < 0.3)[0]
            return "<response>" + serialise_result(rng, value) + "</response>"

        parts = [schema() if rng.random() < 0.5 else response() for _ in range(rng.randint(1, 3))]
        content = serialise_result(rng, s.natural_result(rng.random() < 0.3)[0])
    else:
        def twin(v, key: str | None = None):  # the same keys and shape, other values
            if isinstance(v, dict):
                return {k: twin(x, k) for k, x in v.items()}
            if isinstance(v, list):
                return [twin(x, key) for x in v]
            if isinstance(v, int):
                return rng.randint(-9, 500)
            return s.field(key) if key in NATURAL_FIELDS else s.word()

        value = s.natural_result(rng.random() < 0.3)[0]
        seed = rng.random()  # one serialisation for the content and its twins

        def tagged(v) -> str:
            return "<response>" + serialise_result(random.Random(seed), v) + "</response>"

        parts = [schema() if r < 0.3 else tagged(twin(value)) if r < 0.7 else
                 tagged(s.natural_result(rng.random() < 0.3)[0])
                 for r in [rng.random() for _ in range(rng.randint(1, 4))]]
        content = serialise_result(random.Random(seed), value)
    before, after = NATURAL_FORMATS[natural].split("{content}")
    name = rng.choice(TOOLS).name
    head = "\n".join(parts) + f"\n<response>{content}</response>\n" + before.format(name=name)
    return head + content + after, len(head), content


def arith_drill(rng: random.Random) -> list[tuple[str, str]]:
    """An arithmetic drill (train.py --arith-rows): 4–10 (question, answer) pairs "7 plus 5 " /
    "is 12. " of one_digit_sum."""
    out = []
    for _ in range(rng.randint(4, 10)):
        a, op, b, val = one_digit_sum(rng)
        out.append((f"{a} {op} {b} ", f"is {val}. "))
    return out


def arith_chat(rng: random.Random) -> Example:
    """A one-turn arithmetic chat (train.py --arith-chat): "What is 7 plus 5?" answered as the plain
    kind answers it (one_digit_sum)."""
    u, think, a = arith_turn(*one_digit_sum(rng))
    return Example("plain", None, [{"role": "user", "content": u},
                                   {"role": "assistant", "content": a, "reasoning_content": think}])
