"""Fast tokenizers equal to llama.cpp's, built from a GGUF file's tokenizer.ggml.* metadata (llama-vocab.cpp).

- "gpt2": byte-level BPE, split by the regex that tokenizer.ggml.pre names.
- "gemma4": Gemma 4's SentencePiece-style BPE (merges listed in the file).
- "llama": SentencePiece (Llama 2, Mistral, Gemma 1-3 files; llama.cpp's SPM tokenizer). llama.cpp writes spaces
  as U+2581, puts one in front of every text segment that starts the input or follows a special token
  (tokenizer.ggml.add_space_prefix, default true), then merges adjacent pieces pair by pair, always the pair whose
  joined piece is a token of the highest score (tokenizer.ggml.scores; the leftmost among equals), and writes
  characters no token covers as <0xXX> byte tokens. That is a BPE whose merges are every split of every token
  into two tokens, ranked by the joined token's score: a greedy merge order, so not tokenizers' Unigram (which
  picks the best-scoring segmentation of the whole text). It equals llama.cpp whenever every character of a
  merged token is a token itself and no two different tokens of equal score compete for the same piece (then
  the lower id wins here, the leftmost there), which holds for SentencePiece-trained vocabularies.

The tokens of type control become special tokens (skipped when decoding), user-defined ones added tokens, both
matched in the text before the model runs, as llama.cpp's partition of the text does with special tokens parsed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from flashdraft.config import ConfigError

if TYPE_CHECKING:
    from flashdraft.loading.gguf import GGUFFile

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
NORMAL_TOKEN, UNKNOWN_TOKEN, CONTROL_TOKEN, USER_DEFINED_TOKEN, UNUSED_TOKEN, BYTE_TOKEN = 1, 2, 3, 4, 5, 6
# tokenizer.ggml.model values we build.
TOKENIZER_MODELS = {"gpt2": "byte-level BPE", "gemma4": "SentencePiece-style BPE with byte fallback",
                    "llama": "SentencePiece BPE ranked by tokenizer.ggml.scores, with byte fallback"}
# llama.cpp's defaults for a "llama" vocabulary whose file leaves them out.
SPM_DEFAULT_IDS = {"bos": 1, "eos": 2, "unknown": 0}
SPACE = "\u2581"  # SentencePiece's visible space

# tokenizer.ggml.pre -> split regex of the byte-level BPE pre-tokenizer (llama.cpp llama-vocab.cpp);
# None = GPT-2's own regex.
PRE_TOKENIZER_REGEX = {
    "default": None,
    "gpt-2": None,
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}
# Gemma 4 (llama.cpp's "gemma4"): raw UTF-8 symbols, text split at newline runs.
GEMMA4_SPLIT = r"[^\n]+|[\n]+"


def build_hf_tokenizer(g: GGUFFile):
    """A transformers fast tokenizer equivalent to llama.cpp's for the file's tokenizer.ggml.model."""
    from tokenizers import AddedToken, processors
    from transformers import PreTrainedTokenizerFast

    kind = g.get("tokenizer.ggml.model")
    if kind is None:
        raise ConfigError(f"{g.path}: no tokenizer in the GGUF metadata (tokenizer.ggml.model)")
    if kind not in TOKENIZER_MODELS:
        raise ConfigError(f"{g.path}: unsupported tokenizer model {kind!r}; supported: "
                          + ", ".join(f"{k} ({v})" for k, v in TOKENIZER_MODELS.items()))
    tokens = g.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ConfigError(f"{g.path}: no token list in the GGUF metadata (tokenizer.ggml.tokens)")
    types = _per_token(g, "token_type", len(tokens), NORMAL_TOKEN)

    def token(key):
        i = special_token_id(g, key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    if kind == "gpt2":
        tok = _byte_level_bpe(g, tokens)
    elif kind == "gemma4":
        tok = _gemma4_bpe(g, tokens, token("unknown"))
    else:
        tok = _sentencepiece_bpe(g, tokens, types, token("unknown"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == CONTROL_TOKEN])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED_TOKEN])
    bos = token("bos")
    if g.get("tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=token("eos"),
                                 unk_token=token("unknown"), pad_token=token("padding"))
    hf.chat_template = g.get("tokenizer.chat_template")
    return hf


def special_token_id(g: GGUFFile, key: str) -> int | None:
    """tokenizer.ggml.{key}_token_id, or llama.cpp's default for a "llama" vocabulary that leaves it out."""
    default = SPM_DEFAULT_IDS.get(key) if g.get("tokenizer.ggml.model") == "llama" else None
    value = g.get(f"tokenizer.ggml.{key}_token_id", default)
    return int(value) if value is not None else None


def _per_token(g: GGUFFile, key: str, n: int, default) -> list:
    values = g.get(f"tokenizer.ggml.{key}")
    if values is None:
        return [default] * n
    if len(values) != n:
        raise ConfigError(f"{g.path}: tokenizer.ggml.{key} has {len(values)} entries for {n} tokens")
    return values


def _merges(g: GGUFFile) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) for m in g.get("tokenizer.ggml.merges", [])]


def _byte_level_bpe(g: GGUFFile, tokens: list[str]):
    """GPT-2 style: the pre-tokenizer's split regex, then bytes mapped to printable characters."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer

    pre = g.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_REGEX:
        raise ConfigError(f"{g.path}: unsupported pre-tokenizer {pre!r} (supported: {', '.join(PRE_TOKENIZER_REGEX)})")
    tok = RawTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=_merges(g),
                                  ignore_merges=pre == "llama-bpe"))
    regex = PRE_TOKENIZER_REGEX[pre]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=regex is None)
    tok.pre_tokenizer = byte_level if regex is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(regex), behavior="isolated"), byte_level])
    tok.decoder = decoders.ByteLevel()
    return tok


def _gemma4_bpe(g: GGUFFile, tokens: list[str], unk: str | None):
    """llama.cpp's "gemma4" vocabulary (llama-vocab.cpp): spaces become U+2581, merges run over raw UTF-8
    characters within runs of newlines / non-newlines (its pre-tokenizer, whatever tokenizer.ggml.pre says),
    and a piece without a token falls back to <0xXX> byte tokens. Equal to transformers' GemmaTokenizer whenever
    no merge joins a newline to another character."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer

    merges = _merges(g)
    if not merges:
        raise ConfigError(f"{g.path}: a gemma4 tokenizer needs tokenizer.ggml.merges (none in the file)")
    if g.get("tokenizer.ggml.add_space_prefix", False):
        raise ConfigError(f"{g.path}: tokenizer.ggml.add_space_prefix = true is not supported for a gemma4 tokenizer")
    tok = RawTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, byte_fallback=True,
                                  unk_token=unk, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(GEMMA4_SPLIT), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, highest-scoring joined token first (ties: lower id first), so that
    BPE's merge order is llama.cpp's: the adjacent pair whose joined piece scores highest merges next."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, t in enumerate(tokens):
        for cut in range(1, len(t)):
            left, right = t[:cut], t[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_bpe(g: GGUFFile, tokens: list[str], types: list[int], unk: str | None):
    """llama.cpp's "llama" (SPM) vocabulary as a BPE over the whole text segment: see the module docstring."""
    from tokenizers import decoders, models, normalizers
    from tokenizers import Tokenizer as RawTokenizer

    scores = g.get("tokenizer.ggml.scores")
    if scores is None:
        raise ConfigError(f"{g.path}: a llama (SentencePiece) tokenizer needs tokenizer.ggml.scores: they set "
                          "the order in which pieces merge (none in the file)")
    if len(scores) != len(tokens):
        raise ConfigError(f"{g.path}: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    if len(set(tokens)) != len(tokens):
        raise ConfigError(f"{g.path}: tokenizer.ggml.tokens holds the same text twice")
    byte_tokens = {t for t, k in zip(tokens, types) if k == BYTE_TOKEN}
    tok = RawTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=spm_merges(tokens, scores),
                                  byte_fallback=bool(byte_tokens), unk_token=unk, fuse_unk=True))
    prefix = bool(g.get("tokenizer.ggml.add_space_prefix", True))
    tok.normalizer = normalizers.Sequence([*([normalizers.Prepend(SPACE)] if prefix else []),
                                           normalizers.Replace(" ", SPACE)])
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    # The prefixed space is taken off again, as transformers' Llama/Gemma tokenizers do, so decode(encode(t)) == t.
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok
