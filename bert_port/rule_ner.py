"""`sms_ner`: a named-entity dataset built by rules from the bundled SMS messages.

No annotated NER corpus is available offline, so the tags come from a deterministic rule-based
tagger (`tag_words`), not from annotators: an entity F1 on this data measures how well a model
learns these rules, not how well it finds entities as people mark them. The rules look only at
the lower-cased words and their neighbours, since the bundled all-MiniLM-L6-v2 lower-cases its
input (a capitalisation rule would test nothing the model can see).

Each message is cut into words by `WORD` (currency amounts, numbers with separators, words with
apostrophes, single punctuation marks), then tagged in IOB2; the first rule that claims a word
wins, in this order:
  - PHONE: a number of 10 to 13 digits, or a run of digit groups opened by a group that starts
    with 0 (`0800 169 6031`) holding 10 to 12 digits in all;
  - MONEY: a currency sign and an amount (`£1.50`, `$350`), pence (`150p`, up to 4 digits), or an amount and a
    currency word (`20,000 pounds`);
  - TIME: `8am`, `10:30`, `9pm`, or an hour and `am`/`pm` (`11 am`);
  - DATE: a weekday, today/tomorrow/tonight, or a month name with the day or ordinal before or
    after it and a year after it (`21st may 2005`, `march 3`); `may` and `march` only with a day
    or a year beside them (else they are the verb and the walk);
  - NUM: any other number (`2`, `786`, `1.50`, `2nd`).
The splits (`data.sms_ner_splits`) are those of the bundled `sms` dataset, less the messages in
which the rules find no entity (3,253 of 4,521: 72%; as in CoNLL-2003, where most sentences hold an
entity). On all messages, the O tags swamp the signal: the bundled recipe's run then learnt only
NUM in the same number of steps (docs/fine-tuning.md, "Token classification (NER)"). A model trained here is
therefore not measured on text without entities.
"""

from __future__ import annotations

import re

WORD = re.compile(r"[£$€]\d+(?:[.,]\d+)*|\d+(?:[.,:]\d+)+|\w+(?:'\w+)*|[^\w\s]")
MONTHS = frozenset(
    {
        "january",
        "february",
        "march",
        "april",
        "may",
        "june",
        "july",
        "august",
        "september",
        "october",
        "november",
        "december",
    }
)
AMBIGUOUS_MONTHS = frozenset({"may", "march"})
DAY_WORDS = frozenset(
    {"monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday", "today", "tomorrow", "tonight"}
)
CURRENCY_WORDS = frozenset({"pound", "pounds", "pence", "gbp", "dollars", "euros"})
_NUMBER = re.compile(r"\d+(?:[.,:]\d+)*(?:st|nd|rd|th)?", re.ASCII)
_MONEY = re.compile(r"[£$€]\d.*|\d{1,4}p", re.ASCII)
_TIME = re.compile(r"\d{1,2}(?::\d\d)?(?:am|pm)|\d{1,2}:\d\d", re.ASCII)
_DAY = re.compile(r"\d{1,2}(?:st|nd|rd|th)?", re.ASCII)
_YEAR = re.compile(r"(?:19|20)\d\d", re.ASCII)


def split_words(text: str) -> list[str]:
    return WORD.findall(text)


def _digits(word: str) -> bool:
    return word.isascii() and word.isdigit()


class _Tags:
    """The IOB2 tags of one sentence; a span is tagged only if none of its words is yet."""

    def __init__(self, n: int):
        self.tags = ["O"] * n

    def mark(self, start: int, end: int, kind: str) -> bool:
        if start < 0 or end > len(self.tags) or any(t != "O" for t in self.tags[start:end]):
            return False
        self.tags[start:end] = [f"B-{kind}"] + [f"I-{kind}"] * (end - start - 1)
        return True


def _phones(w: list[str], tags: _Tags) -> None:
    i = 0
    while i < len(w):
        end = i + 1
        if _digits(w[i]) and w[i].startswith("0") and 3 <= len(w[i]) < 10:
            total = len(w[i])
            while end < len(w) and _digits(w[end]) and 3 <= len(w[end]) <= 4 and total < 10:
                total += len(w[end])
                end += 1
            found = 10 <= total <= 12
        else:
            found = _digits(w[i].removeprefix("+")) and 10 <= len(w[i].removeprefix("+")) <= 13
        i = end if found and tags.mark(i, end, "PHONE") else i + 1


def _money(w: list[str], tags: _Tags) -> None:
    for i, word in enumerate(w):
        if _MONEY.fullmatch(word):
            tags.mark(i, i + 1, "MONEY")
        elif _NUMBER.fullmatch(word) and i + 1 < len(w) and w[i + 1] in CURRENCY_WORDS:
            tags.mark(i, i + 2, "MONEY")


def _times(w: list[str], tags: _Tags) -> None:
    for i, word in enumerate(w):
        if _TIME.fullmatch(word):
            tags.mark(i, i + 1, "TIME")
        elif _DAY.fullmatch(word) and _digits(word) and i + 1 < len(w) and w[i + 1] in ("am", "pm"):
            tags.mark(i, i + 2, "TIME")


def _dates(w: list[str], tags: _Tags) -> None:
    for i, word in enumerate(w):
        if word in DAY_WORDS:
            tags.mark(i, i + 1, "DATE")
        elif word in MONTHS:
            start = i - 1 if i > 0 and _DAY.fullmatch(w[i - 1]) else i
            end = i + 1
            if end < len(w) and _DAY.fullmatch(w[end]) and start == i:
                end += 1
            if end < len(w) and _YEAR.fullmatch(w[end]):
                end += 1
            if word not in AMBIGUOUS_MONTHS or (start, end) != (i, i + 1):
                tags.mark(start, end, "DATE")


def tag_words(words: list[str]) -> list[str]:
    """The IOB2 tags of `words` by the rules of the module docstring."""
    lower = [word.lower() for word in words]
    tags = _Tags(len(words))
    for rule in (_phones, _money, _times, _dates):
        rule(lower, tags)
    for i, word in enumerate(lower):
        if _NUMBER.fullmatch(word):
            tags.mark(i, i + 1, "NUM")
    return tags.tags
