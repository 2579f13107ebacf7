"""GGUF "llama" (SentencePiece) tokenizers: the fast tokenizer built from tiny GGUF files written here gives the
ids of a line-by-line Python port of llama.cpp's SPM tokenizer (llama-vocab.cpp: llm_tokenizer_spm_session and the
SPM branch of llama_vocab::impl::tokenize), the ids worked out by hand on a vocabulary designed for it, and, where
the sentencepiece package is installed, sentencepiece's own on a BPE model trained here; decoding gives the text
back."""
import heapq
import random
from pathlib import Path

import gguf
import pytest

from flashdraft.config import ConfigError
from flashdraft.loading.tokenizer import IncrementalText
from flashdraft.loading.gguf import GGUFFile, GGUFTokenizer
from flashdraft.loading.gguf_tokenizer import (BYTE_TOKEN, CONTROL_TOKEN, NORMAL_TOKEN, UNKNOWN_TOKEN, UNUSED_TOKEN,
                                               USER_DEFINED_TOKEN)

SP = "\u2581"
BYTES = [f"<0x{b:02X}>" for b in range(256)]


# --- the reference: llama.cpp's SPM tokenizer, step by step ---

def spm_session(text: str, vocab: dict[str, int], scores: list[float], byte_id) -> list[int]:
    """llm_tokenizer_spm_session::tokenize: UTF-8 characters merged pair by pair, highest score of the joined
    token first, leftmost among equals; then each piece's token, or its bytes' tokens when it has none (only a
    single character can lack one: pieces merge only into tokens, so llama.cpp's resegment never recurses)."""
    symbols = [[i - 1, i + 1 if i + 1 < len(text) else -1, ch] for i, ch in enumerate(text)]  # prev, next, text
    queue = []

    def try_add(left, right):
        if left != -1 and right != -1:
            joined = symbols[left][2] + symbols[right][2]
            if joined in vocab:
                heapq.heappush(queue, (-scores[vocab[joined]], left, right, len(joined)))

    for i in range(1, len(symbols)):
        try_add(i - 1, i)
    while queue:
        _, left, right, size = heapq.heappop(queue)
        ls, rs = symbols[left], symbols[right]
        if not ls[2] or not rs[2] or len(ls[2]) + len(rs[2]) != size:
            continue  # one side was merged into something else meanwhile
        ls[2] += rs[2]
        rs[2] = ""
        ls[1] = rs[1]
        if rs[1] >= 0:
            symbols[rs[1]][0] = left
        try_add(ls[0], left)
        try_add(left, ls[1])
    out = []
    i = 0 if symbols else -1
    while i != -1:
        piece = symbols[i][2]
        out += [vocab[piece]] if piece in vocab else [byte_id(b) for b in piece.encode()]
        i = symbols[i][1]
    return out


def llama_cpp_encode(text: str, tokens, scores, types, bos=1, add_bos=True, add_space_prefix=True) -> list[int]:
    """llama_vocab::impl::tokenize for an SPM vocabulary with special tokens parsed: control, user-defined and
    unknown tokens are cut out of the text first (longest first), each remaining fragment gets a space in front
    when it starts the text or follows such a token, spaces become U+2581, then spm_session."""
    vocab = {t: i for i, t in enumerate(tokens)}
    special = sorted((i for i, k in enumerate(types) if k in (CONTROL_TOKEN, USER_DEFINED_TOKEN, UNKNOWN_TOKEN)),
                     key=lambda i: -len(tokens[i]))
    fragments: list = [text] if text else []
    for sid in special:
        new = []
        for f in fragments:
            if not isinstance(f, str):
                new.append(f)
                continue
            parts = f.split(tokens[sid])
            for j, part in enumerate(parts):
                if j:
                    new.append(sid)
                if part:
                    new.append(part)
        fragments = new
    out = [bos] if add_bos else []
    prev_special = True
    for f in fragments:
        if isinstance(f, str):
            piece = (" " if add_space_prefix and prev_special else "") + f
            out += spm_session(piece.replace(" ", SP), vocab, scores, lambda b: vocab[BYTES[b]])
            prev_special = False
        else:
            out.append(f)
            prev_special = True
    return out


# --- tiny GGUF files ---

def write_vocab(path, tokens, scores=None, types=None, bos=1, eos=2, unk=0, add_bos=True, space_prefix=None,
                model="llama"):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    if scores is not None:
        w.add_token_scores(scores)
    if types is not None:
        w.add_token_types(types)
    for key, value in (("bos", bos), ("eos", eos), ("unk", unk)):
        if value is not None:
            getattr(w, f"add_{key}_token_id")(value)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if space_prefix is not None:
        w.add_add_space_prefix(space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# A vocabulary designed so that every segmentation below can be worked out by hand: higher score merges first.
PIECES = {"ll": -1, "he": -2, "llo": -3, "hello": -4, f"{SP}hello": -5, "or": -6, "ld": -7, f"{SP}w": -8,
          f"{SP}wor": -9, f"{SP}world": -10, f"{SP}{SP}": -11, "é": -12}
CHARS = [SP, "h", "e", "l", "o", "w", "r", "d", "\n", "."]
SPECIALS = ["<unk>", "<s>", "</s>"]
USER = ["<tool>"]


def designed_vocab():
    tokens = SPECIALS + BYTES + CHARS + list(PIECES) + USER + ["<unused0>"]
    scores = [0.0] * (3 + 256) + [-100.0] * len(CHARS) + [float(s) for s in PIECES.values()] + [0.0, 0.0]
    types = ([UNKNOWN_TOKEN, CONTROL_TOKEN, CONTROL_TOKEN] + [BYTE_TOKEN] * 256 + [NORMAL_TOKEN] * len(CHARS)
             + [NORMAL_TOKEN] * len(PIECES) + [USER_DEFINED_TOKEN, UNUSED_TOKEN])
    return tokens, scores, types


@pytest.fixture(scope="module")
def designed(tmp_path_factory):
    tokens, scores, types = designed_vocab()
    path = write_vocab(tmp_path_factory.mktemp("spm") / "v.gguf", tokens, scores, types)
    return GGUFTokenizer(GGUFFile(path)), tokens, scores, types


def test_hand_derived_ids(designed):
    tok, tokens, _, _ = designed
    ids = {t: i for i, t in enumerate(tokens)}

    def enc(text, **kw):
        return [tokens[i] for i in tok.encode(text, **kw)]

    # "▁hello": ll, he, llo, hello, ▁hello merge in score order; "▁world": or, ld, ▁w, ▁wor, ▁world
    assert enc("hello world") == ["<s>", f"{SP}hello", f"{SP}world"]
    # after a newline there is no space: w + or + ld (▁w needs the space)
    assert enc("hello\nworld", add_special_tokens=False) == [f"{SP}hello", "\n", "w", "or", "ld"]
    # two spaces: "▁▁hello" -> ▁▁ scores -11, below ▁hello's pieces: ▁ + ▁hello
    assert enc(" hello", add_special_tokens=False) == [SP, f"{SP}hello"]
    # "lll": both "ll" pairs score alike, the leftmost merges
    assert enc("lll", add_special_tokens=False) == [SP, "ll", "l"]
    # é is a token; 中 (E4 B8 AD) and the tab are not: byte fallback
    assert enc("é中\t.", add_special_tokens=False) == [SP, "é", "<0xE4>", "<0xB8>", "<0xAD>", "<0x09>", "."]
    # control and user-defined tokens in the text; the segment after one gets a space prefix of its own
    assert enc("hello</s>world<tool>.") == ["<s>", f"{SP}hello", "</s>", f"{SP}world", "<tool>", SP, "."]
    assert tok.encode("", add_special_tokens=True) == [ids["<s>"]]
    assert tok.encode("", add_special_tokens=False) == []


TEXTS = ["hello world", "  two  spaces\n\nand a newline", "hello\tworld\r\n", "ünïcödé 中文 🙂 e\u0301",
         "<s>hello</s>", "hello<tool>world<tool>", "lllll oooo", "", " ", "\n", "<unk>x<unused0>", "hellohello"]


def random_texts(n: int, seed: int, alphabet: str):
    rng = random.Random(seed)
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24))) for _ in range(n)]


def test_matches_llama_cpp_on_the_designed_vocab(designed):
    tok, tokens, scores, types = designed
    alphabet = "helowrd .\n\té中" + SP
    joined = [a + "<s>" + b for a, b in zip(random_texts(30, 1, alphabet), random_texts(30, 2, alphabet))]
    for text in TEXTS + random_texts(300, 0, alphabet) + joined:
        assert tok.encode(text) == llama_cpp_encode(text, tokens, scores, types), repr(text)


def test_decode_gives_the_text_back(designed):
    tok, tokens, _, _ = designed
    for text in [t for t in TEXTS if "<" not in t] + random_texts(100, 3, "helowrd .\n\té中🙂"):
        ids = tok.encode(text)
        assert tok.decode(ids) == text, (text, ids)
        detok = IncrementalText(tok.decode)  # the engine's incremental decoding gives the same text
        for k in range(1, len(ids) + 1):
            assert detok.text(ids[:k]) == tok.decode(ids[:k])
    # control and unknown tokens are skipped, byte tokens give their bytes, a user-defined token its text
    ids = {t: i for i, t in enumerate(tokens)}
    seq = [ids["<s>"], ids[f"{SP}hello"], ids["<0xE4>"], ids["<0xB8>"], ids["<0xAD>"], ids["<unk>"], ids["<tool>"]]
    assert tok.decode(seq) == "hello中<tool>"


def test_bos_eos_and_space_prefix_settings(tmp_path):
    tokens, scores, types = designed_vocab()
    # llama.cpp's defaults for a "llama" vocabulary: BOS 1 added, EOS 2, UNK 0, a space prefix
    tok = GGUFTokenizer(GGUFFile(write_vocab(tmp_path / "d.gguf", tokens, scores, types, bos=None, eos=None,
                                             unk=None, add_bos=None)))
    assert tok.encode("hello") == [1, tokens.index(f"{SP}hello")]
    assert (tok.hf.bos_token, tok.eos_token_id, tok.hf.unk_token) == ("<s>", 2, "<unk>")
    # no BOS; no space prefix (Gemma 1-3 files): "hello" is then h + e + llo merged to "hello"
    tok = GGUFTokenizer(GGUFFile(write_vocab(tmp_path / "n.gguf", tokens, scores, types, add_bos=False,
                                             space_prefix=False)))
    for text in TEXTS + random_texts(100, 4, "helowrd .\n"):
        ref = llama_cpp_encode(text, tokens, scores, types, add_bos=False, add_space_prefix=False)
        assert tok.encode(text) == ref, repr(text)
    assert [tokens[i] for i in tok.encode("hello world")] == ["hello", f"{SP}world"]
    assert tok.decode(tok.encode(" hello")) == " hello"
    # a BOS id of its own
    tok = GGUFTokenizer(GGUFFile(write_vocab(tmp_path / "b.gguf", tokens, scores, types, bos=2)))
    assert tok.encode("hello")[0] == 2


def test_bad_vocabularies_are_named(tmp_path):
    tokens, scores, types = designed_vocab()
    cases = {
        "needs tokenizer.ggml.scores": dict(scores=None),
        "tokenizer.ggml.scores has 3 entries": dict(scores=[0.0] * 3),
        "tokenizer.ggml.token_type has 2 entries": dict(types=[1, 1]),
        "unsupported tokenizer model 'bert'": dict(model="bert"),
        "holds the same text twice": dict(tokens=tokens[:-1] + ["he"]),
    }
    for i, (message, change) in enumerate(cases.items()):
        kw = {"tokens": tokens, "scores": scores, "types": types, **change}
        path = write_vocab(tmp_path / f"{i}.gguf", kw.pop("tokens"), **kw)
        with pytest.raises(ConfigError, match=message):
            GGUFTokenizer(GGUFFile(path))


# --- a vocabulary trained by sentencepiece ---

def spm_type(sp, i: int) -> int:
    """convert_hf_to_gguf.py's token type of piece i ("<tool>" is the one user-defined symbol trained here)."""
    if sp.is_unknown(i):
        return UNKNOWN_TOKEN
    if sp.is_control(i):
        return CONTROL_TOKEN
    if sp.is_unused(i):
        return UNUSED_TOKEN
    if sp.is_byte(i):
        return BYTE_TOKEN
    return USER_DEFINED_TOKEN if sp.id_to_piece(i) == "<tool>" else NORMAL_TOKEN


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 600-piece BPE model with byte fallback, trained on this repository's Python source, written to GGUF as
    convert_hf_to_gguf.py does (pieces, scores, types; unk 0, BOS 1, EOS 2)."""
    spm = pytest.importorskip("sentencepiece")
    folder = tmp_path_factory.mktemp("trained")
    src = sorted((Path(__file__).parents[1] / "src" / "flashdraft").rglob("*.py"))
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(p.read_text() for p in src[:40]))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(folder / "m"), vocab_size=600,
                                   model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, split_digits=True, character_coverage=0.9995,
                                   user_defined_symbols=["<tool>"], minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(folder / "m.model"))
    tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    scores = [sp.get_score(i) for i in range(len(tokens))]
    types = [spm_type(sp, i) for i in range(len(tokens))]
    path = write_vocab(folder / "t.gguf", tokens, scores, types)
    return sp, GGUFTokenizer(GGUFFile(path)), tokens, scores, types


def test_matches_sentencepiece_and_llama_cpp_on_a_trained_vocab(trained):
    sp, tok, tokens, scores, types = trained
    text = (Path(__file__).read_text())
    rng = random.Random(5)
    samples = [text[i:i + rng.randint(1, 200)] for i in (rng.randrange(len(text)) for _ in range(200))]
    samples += TEXTS + ["def f(x):\n    return x  # ünïcode 中文 🙂\n", "a<tool>b"]
    for s in samples:
        ours = tok.encode(s, add_special_tokens=False)
        assert ours == llama_cpp_encode(s, tokens, scores, types, add_bos=False), repr(s)
        if "<" not in s:  # sentencepiece does not cut control tokens out of the text
            assert ours == sp.encode(s), repr(s)
        # a written U+2581 decodes as a space; the text after a special or added token gets a space prefix
        if not any(t in s for t in ("<s>", "</s>", "<unk>", "<tool>", SP)):
            assert tok.decode(ours) == s
