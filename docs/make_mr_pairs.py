"""The MR sentence-pair data of the README's "Sentence pairs" section: each review paired with a
hypothesis about its polarity, scored by how well its human rating agrees. Writes
pairs_{train,validation,test}.jsonl in the working folder."""

import json
import random

from bert_port.data import load_mr

mr = load_mr(scores=True)  # MR sentences with their mean human rating in [-4, 4]
order = list(range(len(mr.texts)))
random.Random(0).shuffle(order)  # the file lists positive sentences, then negative ones
HYPOTHESES = ("This review is positive.", "This review is negative.")
rows = []
for i, j in enumerate(order):
    text, rating = mr.texts[j], float(mr.labels[j])
    agreement = (rating / 4 + 1) / 2  # 1: the rating says positive; 0: negative
    hypothesis = HYPOTHESES[i % 2]  # each review is paired with one hypothesis, alternating
    score = agreement if i % 2 == 0 else 1 - agreement
    rows.append({"text": hypothesis, "text_pair": text, "label": score, "entails": "yes" if score > 0.5 else "no"})
for name, part in {"train": rows[:8000], "validation": rows[8000:9000], "test": rows[9000:]}.items():
    with open(f"pairs_{name}.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in part)
