"""Stage 2, tokenizer: a byte-level BPE tokenizer trained on the corpus, and the corpus as token streams.

Writes a tokenizer folder (tokenizer.json + tokenizer_config.json with a ChatML chat template; special tokens
<|endoftext|>, <|im_start|>, <|im_end|> and the drafter's reserved <|mask|>) and tokens/{train,heldout}.bin
(uint16). Each .py file becomes [file tokens, <|endoftext|>]; each function record becomes a chat sample
[user request, assistant answer = the function's source, <|im_end|>, <|endoftext|>] tokenized exactly as the
chat template renders it at inference. The text of files never produces special tokens.

A line break is always a token of its own, never merged with the next line's indentation: a prompt that ends
at a line break (inside a function body, say) then ends on the same token boundary as the training text, where
with GPT-2's pre-tokenizer a lone trailing "\n" only ever preceded a dedent or the end of a file and the model
answered it with <|endoftext|>.

    python -m flashdraft.demo.pipeline.bpe --corpus runs/demo/corpus --out runs/demo/tokenizer --vocab 8192
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from flashdraft.demo.pipeline.corpus import read_jsonl

ENDOFTEXT, IM_START, IM_END, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, MASK]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ENCODE_CHUNK = 2048  # documents per encode_batch call: bounds the memory held as Python lists


def train_bpe(texts, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def save_tokenizer(tok: Tokenizer, folder: Path, model_max_length: int) -> None:
    """tokenizer.json plus a tokenizer_config.json that any transformers version loads as a fast tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "additional_special_tokens": [IM_START, MASK],
        "clean_up_tokenization_spaces": False,  # code must decode byte for byte
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def special_ids(tok: Tokenizer) -> dict[str, int]:
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


class ChatEncoder:
    """Token ids of text and chat prompts, with special tokens only where the format puts them."""

    def __init__(self, tok: Tokenizer):
        self.tok = Tokenizer.from_str(tok.to_str())
        self.tok.encode_special_tokens = True  # a literal "<|endoftext|>" in a source file stays text
        self.ids = special_ids(tok)
        self.newline, self.assistant = self.text(["\n", "assistant\n"])

    def text(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def prompts(self, requests: list[str]) -> list[list[int]]:
        """The chat template's rendering of one user message plus the generation prompt, for each request."""
        start, end = self.ids[IM_START], self.ids[IM_END]
        return [[start, *user, end, *self.newline, start, *self.assistant]
                for user in self.text([f"user\n{r}" for r in requests])]


def encode_documents(enc: ChatEncoder, files: list[dict], functions: list[dict], seed: int) -> np.ndarray:
    """Files and chat samples, shuffled together with a fixed seed, as one uint16 token stream."""
    docs = [("file", f["text"]) for f in files] + [("chat", i) for i in range(len(functions))]
    random.Random(seed).shuffle(docs)
    eot, im_end = enc.ids[ENDOFTEXT], enc.ids[IM_END]
    parts = []
    for i in range(0, len(docs), ENCODE_CHUNK):
        chunk = docs[i:i + ENCODE_CHUNK]
        texts = [d if kind == "file" else functions[d]["code"] for kind, d in chunk]
        prompts = iter(enc.prompts([functions[d]["request"] for kind, d in chunk if kind == "chat"]))
        for (kind, d), ids in zip(chunk, enc.text(texts)):
            if kind == "chat":
                ids = next(prompts) + ids + [im_end]
            parts.append(np.asarray(ids + [eot], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def sample_texts(files: list[dict], functions: list[dict], max_bytes: int):
    """The first max_bytes of the (already shuffled) corpus, plus the chat requests, for BPE training."""
    total = 0
    for f in files:
        if total >= max_bytes:
            break
        total += len(f["text"])
        yield f["text"]
    for fn in functions:
        yield fn["request"]


def build_tokenizer(corpus: Path, out: Path, vocab_size: int = 8192, sample_bytes: int = 24_000_000,
                    model_max_length: int = 4096, seed: int = 0) -> dict:
    if not 256 + len(SPECIAL_TOKENS) < vocab_size <= 65536:
        raise ValueError(f"vocab size must be in ({256 + len(SPECIAL_TOKENS)}, 65536] (uint16 token files), "
                         f"got {vocab_size}")
    t0 = time.monotonic()
    files = read_jsonl(corpus / "train.jsonl")
    functions = read_jsonl(corpus / "functions_train.jsonl")
    tok = train_bpe(sample_texts(files, functions, sample_bytes), vocab_size)
    save_tokenizer(tok, out, model_max_length)
    t_train = time.monotonic() - t0
    enc = ChatEncoder(tok)
    tokens = out / "tokens"
    tokens.mkdir(exist_ok=True)
    train = encode_documents(enc, files, functions, seed)
    held_out = encode_documents(enc, read_jsonl(corpus / "heldout.jsonl"),
                                read_jsonl(corpus / "functions_heldout.jsonl"), seed)
    train.tofile(tokens / "train.bin")
    held_out.tofile(tokens / "heldout.bin")
    train_bytes = sum(len(f["text"].encode()) for f in files) + sum(len(f["code"].encode()) for f in functions)
    stats = {"vocab_size": tok.get_vocab_size(), "special_ids": enc.ids, "train_tokens": int(train.size),
             "heldout_tokens": int(held_out.size), "bytes_per_token": round(train_bytes / max(1, train.size), 3),
             "bpe_seconds": round(t_train, 1), "seconds": round(time.monotonic() - t0, 1)}
    (tokens / "meta.json").write_text(json.dumps(stats, indent=2))
    return stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashdraft.demo.pipeline.bpe", description=__doc__.split("\n")[0])
    p.add_argument("--corpus", type=Path, required=True, help="folder written by the corpus stage")
    p.add_argument("--out", type=Path, required=True, help="tokenizer folder (tokens/ goes inside)")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary size incl. special tokens (default 8192)")
    p.add_argument("--sample-mb", type=float, default=24, help="corpus MB used to train the BPE (default 24)")
    p.add_argument("--model-max-length", type=int, default=4096, help="context length noted in the config")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        stats = build_tokenizer(args.corpus, args.out, args.vocab, int(args.sample_mb * 1e6),
                                args.model_max_length, args.seed)
    except (ValueError, OSError) as e:
        print(f"tokenizer: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
