"""The text the tiny model's BPE tokenizer is trained on: seeded pseudo-English, made at build time.

The tokenizer needs plain text with the statistics of the text it will meet (words, numbers,
punctuation, a little code-like notation), not any text in particular, so it is generated here
rather than shipped: nothing in the repository can be mistaken for the source (a grep finds no
copy of anything), there is no licence to track, and no data file to package. The generator is a
seeded `random.Random` over the fixed word lists below, so `tiny_corpus()` returns the same
string on every machine and every call, and the tokenizer trained on it is the same too.

Sentences are drawn from a few shapes (statements, questions, quotes, lists, numbers of every
common form, short formulas and paths), words by a Zipf-like rank weight as in real text, so the
frequent merges are English ones (" the", "ing", " of"). Every printable ASCII character occurs,
and enough distinct words and numbers occur for the trainer to fill the whole vocabulary.
"""

from __future__ import annotations

import itertools
import random
import string

CORPUS_SEED = 0
# About 190 kB of text: enough distinct pieces for 4,096 tokens, trained in a few seconds.
NUM_PARAGRAPHS = 900

DETERMINERS = "the a this that every each some any no one another its their our my your his her".split()
PRONOUNS = "it they we you she he I someone everyone nobody".split()
PREPOSITIONS = ("of in to for on with at by from about into over after under between through during "
                "before without around across behind beside near against along toward upon").split()
CONJUNCTIONS = "and but or so yet because while although when if until unless since".split()
ADVERBS = ("never always often still already soon again almost quietly slowly quickly nearly only "
           "perhaps rarely gently suddenly together early late twice once here there").split()
ADJECTIVES = (
    "old new small large long short high low early late good bad warm cold dark bright quiet loud "
    "green red blue white black yellow brown grey golden silver wooden narrow wide deep shallow soft "
    "hard heavy light empty full open closed rough smooth strange simple clear sharp broken careful "
    "gentle patient honest busy tired happy sad calm wild young ancient distant northern southern "
    "eastern western hidden famous common rare pleasant bitter sweet dry wet fresh thin thick tall "
    "round square steady sudden final whole single double plain rich poor proud kind brave clever"
).split()
NOUNS = (
    "house river garden window mountain village city road forest field letter story morning evening "
    "night winter summer spring autumn market bridge station harbour island valley hill lake stone "
    "tree flower bird horse dog cat fish boat ship train wagon door wall roof floor table chair lamp "
    "candle book page paper pen song voice music picture colour water fire wind rain snow cloud sky "
    "sun moon star light shadow season year month week day hour minute friend neighbour teacher "
    "farmer baker sailor doctor child family stranger traveller king queen captain soldier merchant "
    "painter writer student library school church castle tower kitchen cellar attic corner street "
    "square coast shore wave sand field meadow orchard apple bread cheese milk coffee tea sugar salt "
    "cup plate knife basket coat hat shoe glove ring coin key box bag rope wheel clock bell map "
    "journey question answer reason promise secret memory dream idea plan rule game lesson word name "
    "number line circle edge path gate fence well pond cottage barn mill farm wood hedge lane"
).split()
VERBS = (
    "walk carry open close watch follow finish start turn answer ask call paint count climb cross "
    "cook clean plant pull push wait wonder visit travel return remember listen look learn laugh "
    "jump help fill gather mend lift share show wish work play rest reach order offer need move "
    "live love hope enter explain describe decide change arrive believe bake build bring buy catch "
    "choose draw drink drive eat fall feel find fly forget give grow hold keep know lead leave lose "
    "make meet pay read ride ring rise run say see sell send sing sit sleep speak spend stand swim "
    "take teach tell think throw understand wake wear win write"
).split()
# Past forms the spelling rule below would get wrong.
IRREGULAR_PAST = dict(
    bring="brought", build="built", buy="bought", catch="caught", choose="chose", draw="drew", drink="drank",
    drive="drove", eat="ate", fall="fell", feel="felt", find="found", fly="flew", forget="forgot", give="gave",
    grow="grew", hold="held", keep="kept", know="knew", lead="led", leave="left", lose="lost", make="made",
    meet="met", pay="paid", read="read", ride="rode", ring="rang", rise="rose", run="ran", say="said",
    see="saw", sell="sold", send="sent", sing="sang", sit="sat", sleep="slept", speak="spoke", spend="spent",
    stand="stood", swim="swam", take="took", teach="taught", tell="told", think="thought", throw="threw",
    understand="understood", wake="woke", wear="wore", win="won", write="wrote",
)
FIRST_NAMES = ("Anna Ben Clara David Elena Felix Greta Hugo Ida Jonas Kira Leo Maya Nils Olga Paul Rosa Sam "
               "Tara Umar Vera Walter Yara Zoe").split()
PLACE_NAMES = "Ashford Brook Carrow Dunmore Elmwood Fairhaven Glenrock Hollow Ironbridge Juniper Kestrel".split()
MONTHS = "January February March April May June July August September October November December".split()
WEEKDAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
UNITS = "km m cm kg g ml l s min h mph".split()
FILE_ENDINGS = "txt md csv json log ini png".split()
# Syllables of invented family and place names: an open supply of rare words, as proper names are
# in real text, so the trainer has pieces left to merge until the vocabulary is full.
ONSETS = "b br c ch d dr f g gr h k l m n p pr r s st sh t th tr v w".split()
VOWELS = "a e i o u ai ea ou".split()
CODAS = ", n r l s th m nd rt ck".split(" ")
NUM_INVENTED_NAMES = 600


def tiny_corpus(seed: int = CORPUS_SEED, num_paragraphs: int = NUM_PARAGRAPHS) -> str:
    """The training text: num_paragraphs paragraphs, each a few lines, blank lines between."""
    writer = _Writer(random.Random(seed))
    paragraphs = [writer.paragraph() for _ in range(num_paragraphs)]
    # Every printable ASCII character at least once, whatever the draws gave.
    paragraphs.append("Characters: " + " ".join(string.printable.strip()))
    return "\n\n".join(paragraphs) + "\n"


def _plural(noun: str) -> str:
    if noun.endswith(("s", "sh", "ch", "x")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


def _third_person(verb: str) -> str:
    return _plural(verb)


def _past(verb: str) -> str:
    if verb in IRREGULAR_PAST:
        return IRREGULAR_PAST[verb]
    if verb.endswith("e"):
        return verb + "d"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ied"
    return verb + "ed"


def _gerund(verb: str) -> str:
    if verb.endswith("e") and not verb.endswith("ee"):
        return verb[:-1] + "ing"
    return verb + "ing"


class _Writer:
    """Draws words and sentences from one random.Random, so one seed fixes the whole text."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.invented_names = sorted({self._invent_name() for _ in range(NUM_INVENTED_NAMES)})
        rng.shuffle(self.invented_names)
        # Cumulative Zipf weights by list length: a word's weight depends only on its rank.
        self._cum_weights: dict[int, list[float]] = {}

    def word(self, words: list[str]) -> str:
        """A word of the list, the first ones the most often (weight 1 / rank, as in real text)."""
        cum = self._cum_weights.get(len(words))
        if cum is None:
            cum = self._cum_weights[len(words)] = list(itertools.accumulate(1.0 / rank for rank in range(1, len(words) + 1)))
        return self.rng.choices(words, cum_weights=cum)[0]

    def _invent_name(self) -> str:
        syllables = [self.rng.choice(ONSETS) + self.rng.choice(VOWELS) + self.rng.choice(CODAS)
                     for _ in range(self.rng.randint(2, 3))]
        return "".join(syllables).capitalize()

    # ---- phrases --------------------------------------------------------------------------

    def noun_phrase(self) -> str:
        rng = self.rng
        roll = rng.random()
        if roll < 0.12:
            return rng.choice(FIRST_NAMES)
        if roll < 0.2:
            return rng.choice(PRONOUNS)
        if roll < 0.28:
            name = self.word(self.invented_names)
            return rng.choice([f"{rng.choice(FIRST_NAMES)} {name}", f"the {name} {self.word(NOUNS)}", name])
        noun = self.word(NOUNS)
        if rng.random() < 0.3:
            noun = _plural(noun)
            determiner = rng.choice(["the", "some", "many", "few", "all the", "two", "three", "our", "their"])
        else:
            determiner = self.word(DETERMINERS)
        if rng.random() < 0.45:
            adjective = self.word(ADJECTIVES)
            if rng.random() < 0.15:
                adjective = f"{adjective}, {self.word(ADJECTIVES)}"
            noun = f"{adjective} {noun}"
        if determiner == "a" and noun[0] in "aeiou":
            determiner = "an"
        return f"{determiner} {noun}"

    def verb_phrase(self) -> str:
        rng = self.rng
        verb = self.word(VERBS)
        form = rng.random()
        if form < 0.4:
            verb = _past(verb)
        elif form < 0.6:
            verb = _third_person(verb)
        elif form < 0.8:
            verb = f"{rng.choice(['was', 'is', 'were', 'had been', 'will be'])} {_gerund(verb)}"
        else:
            verb = f"{rng.choice(['will', 'can', 'could', 'should', 'might', 'did not', 'would'])} {verb}"
        if rng.random() < 0.25:
            verb = f"{self.word(ADVERBS)} {verb}"
        phrase = f"{verb} {self.noun_phrase()}"
        if rng.random() < 0.5:
            phrase += f" {self.word(PREPOSITIONS)} {self.noun_phrase()}"
        return phrase

    def clause(self) -> str:
        return f"{self.noun_phrase()} {self.verb_phrase()}"

    # ---- sentences ------------------------------------------------------------------------

    def sentence(self) -> str:
        rng = self.rng
        shape = rng.random()
        if shape < 0.45:
            text = self.clause()
            if rng.random() < 0.4:
                text += f", {rng.choice(CONJUNCTIONS)} {self.clause()}"
            return _capitalise(text) + rng.choice([".", ".", ".", ".", "!", ";"] if shape < 0.4 else ["..."])
        if shape < 0.55:
            return _capitalise(f"{rng.choice(['did', 'will', 'could', 'why did', 'when will', 'how can'])} "
                               f"{self.noun_phrase()} {self.word(VERBS)} {self.noun_phrase()}") + "?"
        if shape < 0.65:
            speaker = rng.choice(FIRST_NAMES)
            said = rng.choice(["said", "asked", "called", "whispered", "answered"])
            return f'"{_capitalise(self.clause())}," {speaker} {said}.'
        if shape < 0.75:
            return _capitalise(f"{self.clause()} ({self.number()} {self.word(NOUNS)}s, {self.date()})") + "."
        if shape < 0.85:
            return _capitalise(f"{self.word(PREPOSITIONS)} {self.time_or_date()}, {self.clause()}") + "."
        return _capitalise(f"{self.clause()}: {self.measure()}, {self.measure()} and {self.money()}") + "."

    def paragraph(self) -> str:
        rng = self.rng
        kind = rng.random()
        if kind < 0.1:
            return self.listing()
        if kind < 0.2:
            return self.notation()
        if kind < 0.25:
            return f"{self.title()}\n{'=' * rng.randint(4, 24)}"
        return " ".join(self.sentence() for _ in range(rng.randint(2, 6)))

    def title(self) -> str:
        return " ".join(_capitalise(w) for w in f"the {self.word(ADJECTIVES)} {self.word(NOUNS)}".split())

    def listing(self) -> str:
        rng = self.rng
        bullet = rng.choice(["- ", "* ", "+ ", "numbered"])
        lines = [_capitalise(self.noun_phrase()) + ":"]
        for index in range(rng.randint(2, 6)):
            mark = f"{index + 1}. " if bullet == "numbered" else bullet
            lines.append(f"{' ' * rng.choice([0, 2, 4])}{mark}{self.clause()}")
        return "\n".join(lines)

    # ---- numbers --------------------------------------------------------------------------

    def number(self) -> str:
        rng = self.rng
        roll = rng.random()
        if roll < 0.4:
            return str(rng.randint(0, 99))
        if roll < 0.7:
            return str(rng.randint(100, 9999))
        if roll < 0.85:
            return f"{rng.randint(1, 999)},{rng.randint(0, 999):03d}"
        return f"{rng.randint(0, 99)}.{rng.randint(0, 99):02d}"

    def date(self) -> str:
        rng = self.rng
        year = rng.randint(1850, 2040)
        if rng.random() < 0.5:
            return f"{rng.randint(1, 28)} {rng.choice(MONTHS)} {year}"
        return f"{year}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"

    def time_or_date(self) -> str:
        rng = self.rng
        if rng.random() < 0.5:
            return f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} on {rng.choice(WEEKDAYS)}"
        return self.date()

    def measure(self) -> str:
        rng = self.rng
        if rng.random() < 0.3:
            return f"{rng.randint(1, 100)}%"
        return f"{self.number()} {rng.choice(UNITS)}"

    def money(self) -> str:
        return f"${self.rng.randint(1, 500)}.{self.rng.randint(0, 99):02d}"

    # ---- notation: formulas, paths, addresses, markup ------------------------------------------

    def name(self) -> str:
        rng = self.rng
        first = self.word(NOUNS)
        return first if rng.random() < 0.6 else f"{self.word(ADJECTIVES)}_{first}"

    def notation(self) -> str:
        rng = self.rng
        lines = []
        for _ in range(rng.randint(2, 5)):
            a, b, c = self.name(), self.name(), self.name()
            n = self.number().replace(",", "")
            line = rng.choice([
                f"{a} = {b} + {n}",
                f"{a} = ({b} - {c}) * {rng.randint(2, 9)} / {rng.randint(2, 9)}",
                f"if {a} >= {n} and {b} != {c}: {a} += 1",
                f"{a}[{rng.randint(0, 9)}] <= {b}[{rng.randint(0, 9)}] || !{c}",
                f"{{\"{a}\": {n}, \"{b}\": \"{self.word(ADJECTIVES)}\"}}",
                f"{rng.choice(PLACE_NAMES).lower()}/{a}/{b}.{rng.choice(FILE_ENDINGS)}",
                f"~/{a}/{b}-{rng.randint(1, 99)}.{rng.choice(FILE_ENDINGS)}",
                f"{rng.choice(FIRST_NAMES).lower()}@{rng.choice(PLACE_NAMES).lower()}.example.org",
                f"<{a}>{self.word(NOUNS)}</{a}> & <{b} {c}=\"{n}\"/>",
                f"`{a}` | `{b}` ^ {n} # {self.word(ADJECTIVES)} {self.word(NOUNS)}",
                f"{a}({b}, {c}) -> {n}; {b} := {c} % {rng.randint(2, 12)}",
                f"\\{a}\\{b}\\{c} (see @{self.word(NOUNS)} and #{self.word(NOUNS)})",
            ])
            lines.append(" " * rng.choice([0, 0, 4, 8]) + line)
        return "\n".join(lines)


def _capitalise(text: str) -> str:
    return text[:1].upper() + text[1:]
