"""Prompts of chosen token lengths, cut from a fixed English text, for the equality tests."""

from __future__ import annotations

TEXT = (
    "The history of the lighthouse begins with fires lit on hilltops to guide ships home. "
    "In the ancient harbour of Alexandria a great tower rose above the sea, and its light was said "
    "to be visible for many miles. Sailors who had crossed the open water looked for that glow with "
    "relief, because it meant the dangerous rocks near the shore could be avoided. Over the centuries "
    "the design of such towers changed a great deal. Wood fires gave way to candles, candles to oil "
    "lamps, and oil lamps to electric bulbs focused by enormous glass lenses. The keeper of a lighthouse "
    "led a lonely life: he trimmed the wicks, polished the brass, wound the clockwork that turned the "
    "lens, and wrote every change of weather into a logbook. Storms could cut a rock station off from "
    "the mainland for weeks, and supply boats arrived only when the sea allowed. "
    "Cooking is another old craft that rewards patience. A good soup starts with onions cooked slowly "
    "in butter until they are soft and sweet, then carrots, celery and a few cloves of garlic. Water "
    "or stock is added, together with herbs such as thyme and bay, and the pot simmers for an hour. "
    "Salt should be added little by little, tasting as you go, since it is easy to add more but "
    "impossible to take it away. Bread baked the same morning makes the meal complete. "
    "Mathematics, too, has a long story. The ancient Greeks proved that there are infinitely many prime "
    "numbers with an argument so short that it is still taught to students today: suppose there were "
    "only finitely many, multiply them all together and add one, and the new number has a prime factor "
    "that was missing from the list. Centuries later, mathematicians in India developed the decimal "
    "system with a symbol for zero, which travelled west and changed how merchants kept their accounts. "
    "Today computers perform billions of additions every second, yet the rules they follow are the same "
    "ones a child learns at school. A computer program is a list of instructions, written so precisely "
    "that a machine can follow them without any understanding of what they mean. Programmers break a "
    "large problem into small pieces, test each piece on its own, and then join the pieces together. "
    "When something goes wrong they read the program line by line, form a guess about the cause, and "
    "check that guess with an experiment. Gardening teaches similar lessons. Seeds planted too early "
    "are killed by frost, and seeds planted too late do not ripen before autumn. A gardener watches the "
    "soil, the sky and the insects, and learns each year a little more about the small piece of land "
    "that they care for. Tomatoes need sun and regular water; beans climb any support they can find; "
    "and the weeds, of course, grow best of all. Rivers shape the land they cross. Over thousands of "
    "years a river cuts a valley, carries sand and stones down towards the sea, and builds a delta where "
    "its water finally slows. Cities grew along rivers because they offered water, food and a road for "
    "boats long before there were railways. "
)


def prompt_of_length(tokenizer, n_tokens: int, offset_words: int = 0) -> list[int]:
    """The first n_tokens tokens of the text, starting `offset_words` words in."""
    words = TEXT.split()
    text = " ".join(words[offset_words:] + words[:offset_words])
    ids = tokenizer(text, add_special_tokens=False).input_ids
    while len(ids) < n_tokens:
        ids = ids + ids
    return ids[:n_tokens]


# (prompt tokens, new tokens, word offset): 8 prompts of 5 to 600 tokens, 32 to 128 new tokens.
CASES = [
    (5, 128, 0),
    (17, 96, 40),
    (64, 64, 90),
    (130, 48, 150),
    (250, 32, 210),
    (333, 40, 30),
    (470, 32, 120),
    (600, 32, 260),
]

# A second passage: TEXT + MORE_TEXT is over 1,000 tokens, the fixed text the quantized models
# are scored on (tests/engine/test_gguf_quant.py, benchmarks/quant_quality.py).
MORE_TEXT = (
    " Music is one of the oldest ways people have found to share a feeling. Long before anyone wrote notes "
    "on paper, shepherds played simple flutes cut from reeds, and villages gathered to sing at harvest time. "
    "A melody passed from parent to child, changing a little with every voice that carried it. When printing "
    "arrived, songs could travel much further, and a tune written in one city might be played in another a "
    "year later. Orchestras grew larger, instruments grew louder, and concert halls were built to hold the "
    "sound. Trains changed the way people thought about distance. A journey that once took a week by coach "
    "could be finished in a single day, and towns that had been far apart became neighbours. Railway "
    "companies laid tracks across plains, cut tunnels through mountains and built bridges over wide rivers. "
    "Because every town had kept its own local time, the railways needed a shared timetable, and so the "
    "hours themselves were standardised across whole countries. The moon has always attracted curious eyes. "
    "Early observers noticed that it changed its shape through a regular cycle of about four weeks, and many "
    "calendars were built on that cycle. With the first telescopes, astronomers saw mountains and craters and "
    "wide grey plains that they called seas, although there is no water in them. Much later, rockets carried "
    "people across the empty space between the earth and the moon, and they walked on its dusty surface, "
    "collected stones and returned safely home. Libraries keep the memory of a community. A good library is "
    "quiet but never empty: students prepare for examinations, older readers look through newspapers, and "
    "children sit on the floor with picture books. Catalogues once filled drawers of paper cards; now they "
    "are searched on a screen, but the idea is unchanged. Every book has a place, and anyone may come in. "
    "Bridges are promises made in stone and steel. An engineer who designs one must think about the weight of "
    "the traffic, the force of the wind, the slow push of the river against the piers and the way metal grows "
    "longer on a hot afternoon. Old bridges were built of timber or of carefully cut blocks that held each "
    "other up in an arch; later ones hang from cables stretched between tall towers. People who cross them "
    "every day rarely think about any of this, which is exactly what the engineer hoped for."
)
