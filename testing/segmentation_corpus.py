"""Hard cases for sentence splitting, each with the sentences a narrator should read it as.

Used by tests/jobs/test_segmentation.py (the splitter must get every one) and bench/segmenters.py
(the splitter against sentencex). ``TRADE_OFFS`` are cases whose right answer the splitter
deliberately gives up (docs/architecture.md says why); they are measured, not asserted."""

CASES: list[tuple[str, list[str]]] = [
    # abbreviations and titles
    ("Dr. Smith arrived. He sat down.", ["Dr. Smith arrived.", "He sat down."]),
    ("Mr. and Mrs. Jones left early.", ["Mr. and Mrs. Jones left early."]),
    ("See Fig. 3 for details. It shows the curve.", ["See Fig. 3 for details.", "It shows the curve."]),
    ("It is approx. 5 km away, i.e. close.", ["It is approx. 5 km away, i.e. close."]),
    ("Prof. Ada Lovelace, Jr. was not her name.", ["Prof. Ada Lovelace, Jr. was not her name."]),
    ("The U.S. Navy sailed. It was dawn.", ["The U.S. Navy sailed.", "It was dawn."]),
    ("Talks in the U.K. Parliament ran late.", ["Talks in the U.K. Parliament ran late."]),
    ("We met at 5 p.m. on Friday.", ["We met at 5 p.m. on Friday."]),
    # initials
    ("J. R. R. Tolkien wrote it. Lewis read it.", ["J. R. R. Tolkien wrote it.", "Lewis read it."]),
    ("George W. Bush spoke briefly.", ["George W. Bush spoke briefly."]),
    # decimals, currencies, percentages
    ("Pi is 3.14159 roughly. Fine.", ["Pi is 3.14159 roughly.", "Fine."]),
    ("It rose 2.5% in Q3. Then it fell.", ["It rose 2.5% in Q3.", "Then it fell."]),
    ("It costs $4.99 today. Tomorrow it is €5.50.", ["It costs $4.99 today.", "Tomorrow it is €5.50."]),
    ("He paid £1,000.00 in cash. She did not.", ["He paid £1,000.00 in cash.", "She did not."]),
    # URLs, e-mail, versions, file names
    ("Visit https://example.com/a.b?c=d. Then log in.", ["Visit https://example.com/a.b?c=d.", "Then log in."]),
    ("Email john.doe@example.org for help. Thanks.", ["Email john.doe@example.org for help.", "Thanks."]),
    ("Upgrade to v2.3.1 now. It fixes bugs.", ["Upgrade to v2.3.1 now.", "It fixes bugs."]),
    ("Python 3.11 is out. Try it.", ["Python 3.11 is out.", "Try it."]),
    ("Open config.yaml first. Edit it.", ["Open config.yaml first.", "Edit it."]),
    # quotes
    ('"Stop!" she cried. He stopped.', ['"Stop!" she cried.', "He stopped."]),
    ('"Are you sure?" "Yes."', ['"Are you sure?"', '"Yes."']),
    ("He said, 'It is late.' Then he left.", ["He said, 'It is late.'", "Then he left."]),
    ("“Run,” she said. “Now.”", ["“Run,” she said.", "“Now.”"]),
    ("(This is an aside.) The story goes on.", ["(This is an aside.)", "The story goes on."]),
    # ellipses
    ("Wait... What was that? Nothing.", ["Wait...", "What was that?", "Nothing."]),
    ("I think… maybe not.", ["I think… maybe not."]),
    ("Well . . . perhaps.", ["Well . . . perhaps."]),
    # other scripts and their punctuation
    ("这是第一句。这是第二句。", ["这是第一句。", "这是第二句。"]),
    ("これは一つ目です！二つ目？はい。", ["これは一つ目です！", "二つ目？", "はい。"]),
    ("¿Dónde está? Aquí está.", ["¿Dónde está?", "Aquí está."]),
    ("¡Hola! ¿Qué tal?", ["¡Hola!", "¿Qué tal?"]),
    ("Это первое. Это второе.", ["Это первое.", "Это второе."]),
    ("Das ist z.B. gut. Ja.", ["Das ist z.B. gut.", "Ja."]),
    ("هذه جملة. هذه أخرى.", ["هذه جملة.", "هذه أخرى."]),
    ("Ceci est «très» bien. Oui.", ["Ceci est «très» bien.", "Oui."]),
    # numbers that end sentences, and lists
    ("The answer is 42. Nobody asked.", ["The answer is 42.", "Nobody asked."]),
    ("He was born in 1990. He moved in 2001.", ["He was born in 1990.", "He moved in 2001."]),
    ("Take 2 tbsp. of sugar.", ["Take 2 tbsp. of sugar."]),
]

#: Right answers the splitter gives up on purpose: an initialism that really ends a sentence
#: merges with the next one (a break inside "U.S. Navy" would be worse).
TRADE_OFFS: list[tuple[str, list[str]]] = [
    ("She moved to the U.S. Then she studied.", ["She moved to the U.S.", "Then she studied."]),
    ("We left at 5 p.m. Nobody stayed.", ["We left at 5 p.m.", "Nobody stayed."]),
]
