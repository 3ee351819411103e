"""Named architectures with seeded random weights (no hub: configs are written here).

Full-size ones match the real models' shapes (parameter counts in comments);
tiny ones keep the same code path and exist for fast tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Architecture:
    name: str
    family: str  # "bert" | "distilbert" | "gpt2" | "resnet"
    default_task: str
    tasks: tuple[str, ...]
    config: dict[str, Any] = field(default_factory=dict)
    packrat: dict[str, Any] = field(default_factory=dict)  # default packrat.* settings


_TEXT_TASKS = ("text-classification", "feature-extraction")

ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in [
        # bert-base-uncased shapes: 109.5M params (+ classifier head)
        Architecture("bert-base", "bert", "text-classification", _TEXT_TASKS,
                     dict(num_labels=2), dict(max_length=128)),
        # distilbert-base-uncased shapes: 66M params
        Architecture("distilbert", "distilbert", "text-classification", _TEXT_TASKS,
                     dict(num_labels=2), dict(max_length=128)),
        # GPT-2 124M
        Architecture("gpt2", "gpt2", "text-generation", ("text-generation",),
                     dict(), dict(max_length=128, max_new_tokens_cap=64, default_max_new_tokens=16)),
        # ResNet-50: 25.6M params, 1000 classes
        Architecture("resnet50", "resnet", "image-classification", ("image-classification",),
                     dict(num_labels=1000), dict(top_k=5)),
        Architecture("tiny-bert", "bert", "text-classification", _TEXT_TASKS,
                     dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=64, num_labels=2),
                     dict(max_length=64)),
        Architecture("tiny-distilbert", "distilbert", "text-classification", _TEXT_TASKS,
                     dict(dim=32, n_layers=2, n_heads=2, hidden_dim=64, num_labels=2),
                     dict(max_length=64)),
        Architecture("tiny-gpt2", "gpt2", "text-generation", ("text-generation",),
                     dict(n_embd=32, n_layer=2, n_head=2, n_positions=256, vocab_size=1000),
                     dict(max_length=64, max_new_tokens_cap=16, default_max_new_tokens=8)),
        Architecture("tiny-resnet", "resnet", "image-classification", ("image-classification",),
                     dict(embedding_size=8, hidden_sizes=[8, 16, 16, 32], depths=[1, 1, 1, 1],
                          layer_type="basic", num_labels=10),
                     dict(top_k=3)),
    ]
}


def build_model(arch: Architecture, task: str, seed: int):
    """(model, tokenizer or None) with weights drawn from torch's RNG seeded with `seed`."""
    import torch
    import transformers as tf

    from packrat.archive import local_tokenizers

    max_length = int(arch.packrat.get("max_length", 128))
    torch.manual_seed(seed)
    if arch.family == "bert":
        config = tf.BertConfig(**arch.config)
        cls = tf.BertForSequenceClassification if task == "text-classification" else tf.BertModel
        return cls(config).eval(), local_tokenizers.bert_tokenizer(max_length)
    if arch.family == "distilbert":
        config = tf.DistilBertConfig(**arch.config)
        cls = (tf.DistilBertForSequenceClassification if task == "text-classification"
               else tf.DistilBertModel)
        return cls(config).eval(), local_tokenizers.bert_tokenizer(max_length)
    if arch.family == "gpt2":
        config = tf.GPT2Config(**arch.config)
        tokenizer = local_tokenizers.gpt2_tokenizer(config.vocab_size, config.n_positions)
        config.bos_token_id = config.eos_token_id = config.pad_token_id = tokenizer.eos_token_id
        return tf.GPT2LMHeadModel(config).eval(), tokenizer
    if arch.family == "resnet":
        config = tf.ResNetConfig(**arch.config)
        return tf.ResNetForImageClassification(config).eval(), None
    raise ValueError(f"unknown family {arch.family}")


