"""Vocabulary and filler text of the RULER tasks: word lists, essay-like sentences, RULER's noise
sentence, and the random keys and values of needles (all drawn from a seeded ``random.Random``).
"""

from __future__ import annotations

import random
import uuid

ADJECTIVES = """
able ancient angry bitter black bold brave bright broad calm careful cheap clean clever
cold cool crazy cruel curious damp dark dear deep dense dry dull eager early easy empty
equal fair famous fancy fast fierce fine firm flat fresh friendly funny gentle giant glad
golden good grand great green happy hard harsh heavy hollow honest huge humble hungry
jolly kind large late lazy light little lively lonely long loud lucky mighty modern narrow
neat nervous noble noisy odd old pale patient plain polite poor proud quick quiet rapid
rare raw red rich rough round royal rude sad safe scarce sharp shiny short shy silent
silly simple slim slow small smart smooth soft solid sour spicy steady steep sticky stiff
strange strict strong sunny sweet swift tall tame tender thick thin tidy tiny tough ugly
vast violet warm weak wet white wide wild wise witty young yellow zealous
""".split()
NOUNS = """
actor airport anchor animal answer apple arch area army arrow artist author autumn baby
badge bakery balance ball band bank barn basket beach bean bear bed bell bench bicycle
bird blanket boat bone book border bottle bowl box branch bread bridge brother brush
bucket building butter button cabin cable cake camera camp candle canal canvas captain
car card carpet castle cat cave chain chair chalk channel cheese chest child church
circle city cliff clock cloud coast coat coffee coin comet compass cook corner cotton
country cousin cow crane crowd crown cup curtain cushion daisy dancer desert desk diamond
doctor dog dolphin door dragon drawer dream drum eagle earth engine envelope factory
falcon farm feather fence field finger fire fish flag flame flower forest fountain fox
friend frog garden gate giraffe glass globe glove goat grape guitar hammer harbor hat
helmet hill horse hospital hotel house island jacket jewel journal jungle kettle key king
kitchen kite ladder lake lamp lantern leaf lemon letter library lion lizard lock machine
map market meadow melon mirror monkey moon mountain museum needle nest ocean office
orange orchard owl painter palace paper parrot path pencil piano picture pilot planet
plate pocket poet pond queen rabbit radio rainbow river road robot rocket roof rope sail
sailor salad school scissors sea shadow sheep shell ship shirt shoe shop singer sister
sky snake soldier spoon square stamp star station statue stone storm stove street sugar
sun table teacher temple tent thunder ticket tiger tower town toy tractor train tree
truck tunnel turtle umbrella valley vase village violin volcano wagon wall wallet whale
wheel window winter wolf wood world zebra
""".split()
VERBS = """
admired answered borrowed built carried chased cleaned climbed collected copied counted
covered crossed described designed discovered divided drew explored filled followed found
gathered guarded helped hid imagined improved joined kept lifted lost measured mended
moved noticed opened ordered painted passed photographed planted polished prepared
pulled pushed raised reached read remembered repaired rescued returned saved searched
shared showed studied supported tested touched traded trusted understood visited washed
watched welcomed wrote
""".split()
ADVERBS = """
again almost always boldly briefly calmly carefully clearly eagerly easily finally gently
gladly happily honestly kindly loudly nearly neatly never often openly patiently politely
quickly quietly rarely really seldom simply slowly softly soon suddenly surely swiftly
today together warmly wisely
""".split()
PREPOSITIONS = "above across after along around behind below beside beyond near over under".split()

_ESSAY_TEMPLATES = (
    "The {adj} {noun} {verb} the {noun2} {prep} the {adj2} {noun3}.",
    "{Adv}, the {noun} {verb} every {adj} {noun2}.",
    "When the {noun} {verb} the {noun2}, the {adj} {noun3} {verb2} it {adv}.",
    "It is {adj} that the {noun} {verb} the {noun2} {adv}.",
    "One {adj} {noun} {verb} the {noun2} and the {noun3}.",
    "Nobody {verb} the {adj} {noun} {prep} the {noun2}.",
    "Perhaps the {noun} {verb} the {noun2} because the {noun3} was {adj}.",
    "In the {adj} {noun}, a {noun2} {verb} the {adj2} {noun3} {adv}.",
    "The {noun} was {adj}, and the {noun2} was {adj2}.",
    "Every {noun} {verb} some {adj} {noun2} {prep} the {noun3}.",
)
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
# How many distinct needle keys/values of each type exist ("words" are adjective-noun pairs).
NUM_DISTINCT = {"words": len(ADJECTIVES) * len(NOUNS), "numbers": 9 * 10**6, "uuids": 2**122}


def substring_free(words: list[str]) -> list[str]:
    """Unique words, none of which is a substring of another (so a containment check of one
    word never credits another)."""
    uniq = sorted(set(words))
    return [w for w in uniq if not any(w != o and w in o for o in uniq)]


# Words of cwe's lists and answers: no word contains another.
LIST_WORDS = substring_free(NOUNS + ADJECTIVES + VERBS)


def noise_units():
    """RULER's noise sentence, endlessly."""
    while True:
        yield NOISE


def essay_units(rng: random.Random):
    """Endless essay-like sentences (no digits, no hyphens)."""
    while True:
        t = rng.choice(_ESSAY_TEMPLATES)
        adv = rng.choice(ADVERBS)
        yield t.format(adj=rng.choice(ADJECTIVES), adj2=rng.choice(ADJECTIVES),
                       noun=rng.choice(NOUNS), noun2=rng.choice(NOUNS), noun3=rng.choice(NOUNS),
                       verb=rng.choice(VERBS), verb2=rng.choice(VERBS), adv=adv,
                       Adv=adv.capitalize(), prep=rng.choice(PREPOSITIONS))


def word_key(rng: random.Random) -> str:
    """An "adjective-noun" word (RULER's word keys and values)."""
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def random_value(rng: random.Random, kind: str) -> str:
    """A random needle key or value of ``kind``: "numbers" (7 digits), "words" or "uuids"
    (version-4 UUID text), as RULER's ``generate_random``."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return word_key(rng)
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def distinct(rng: random.Random, n: int, draw) -> list[str]:
    """``n`` distinct results of ``draw(rng)``, in the order first drawn."""
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        v = draw(rng)
        if v not in seen:
            seen.add(v)
            out.append(v)
    return out
