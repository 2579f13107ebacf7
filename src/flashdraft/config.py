"""Configuration dataclasses built from Hugging Face config.json files, and sampling parameters."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A model or drafter folder whose configuration cannot be used; the message names the problem."""


# Architectures whose decoder we implement, keyed by HF model_type.
SUPPORTED_MODEL_TYPES = ("qwen3", "llama")



# Temperatures below this decode greedily (as vLLM's _SAMPLING_EPS does). Far below it, float32 logits divided by
# the temperature overflow and the softmax turns to NaN (1e-38 gave empty output); near it, the noise of two
# tokens differs by at most ~20, so only a logit within 20 * 1e-5 of the top one could have won by sampling.
GREEDY_BELOW = 1e-5

# A prompt runs in passes of at most this many tokens (-ub/--ubatch-size changes it): a pass's activations, and
# the attention mask of its rows over the cache, grow with its length, so a 32K-token prompt in one pass would
# need gigabytes more than the model's steps (a 32K x 32K boolean mask alone is 1 GiB). 512 is llama-server's
# default: with it the walkthrough's Gemma-4-31B setup at 32K fits a 24 GB card (H200: 22.78 GB peak, 24.03 with
# passes of 2048, whose 32K prompt ran in 9.1 s against 10.8; docs/performance.md).
PREFILL_CHUNK = 512

# The drafter sees the last this many committed tokens unless told otherwise (--spec-dflash-cross-ctx N; 0: all of
# them): its context cache is a ring of DRAFT_WINDOW + block rows, so its memory and a draft pass's reads stay
# constant however long a conversation grows (at 32K tokens the whole context would be 32x this). On the demo pair
# with ~3800 tokens of context, no window from 64 tokens to all of them changed tau (docs/performance.md); a
# conversation's next turn reuses the ring whatever it still holds (models.kv_cache.WindowKVCache). BeeLlama's
# default is 512, its quickstarts' and the walkthrough's 1024.
DRAFT_WINDOW = 1024

# A pass's token count is padded with filler rows up to one of a few sizes (prefill_buckets; on CUDA by default,
# SpeculativeDecoder's pad_prefill). On a GPU every new row count pays a first use of its GEMM and attention kernels
# (cuBLAS's heuristics, Triton kernels specialised on sizes), so a server's first prompt of a length ran slower than
# its tenth; a few sizes can all be run once at load (Engine.warm_up). Powers of two up to PREFILL_BUCKET_STEP,
# where a pass reads the weights more than it computes (up to about 200 rows on an H200, by its peak compute over
# its memory bandwidth) and extra rows cost little; multiples of it beyond, where the time grows with the rows, so a
# long pass pads by less than PREFILL_BUCKET_STEP rows.
PREFILL_BUCKET_MIN = 16  # a tile of the few-row GEMM (layers.skinny_gemm.BLOCK_M), which the decoding steps run too
PREFILL_BUCKET_STEP = 256


def prefill_buckets(chunk: int) -> tuple[int, ...]:
    """The sizes passes of at most `chunk` tokens are padded to, ascending: powers of two from PREFILL_BUCKET_MIN to
    PREFILL_BUCKET_STEP, then its multiples, those below `chunk`, and `chunk` itself (a long prompt's full passes)."""
    sizes, size = [], PREFILL_BUCKET_MIN
    while size < chunk:
        sizes.append(size)
        size = 2 * size if size < PREFILL_BUCKET_STEP else size + PREFILL_BUCKET_STEP
    return (*sizes, chunk)


@dataclass
class ModelConfig:
    """Shape and numerics of a decoder-only transformer (the target, or the drafter's layer stack)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    qk_norm: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            arch = raw.get("architectures") or [model_type]
            raise ConfigError(
                f"{source}: unsupported architecture {arch} (model_type={model_type!r}); "
                f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in raw]
        if missing:
            raise ConfigError(f"{source}: missing required field(s) {missing}")
        heads = int(raw["num_attention_heads"])
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        eos = raw.get("eos_token_id")
        rope_scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
        rope_theta = raw.get("rope_theta")
        if rope_theta is None and isinstance(rope_scaling, dict):
            rope_theta = rope_scaling.get("rope_theta")
        if isinstance(rope_scaling, dict) and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            qk_norm=model_type == "qwen3",
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=as_id_list(eos),
            bos_token_id=raw.get("bos_token_id"),
        )

    @classmethod
    def from_file(cls, path: Path) -> "ModelConfig":
        return cls.from_dict(read_json(path), source=str(path))


@dataclass
class DrafterConfig:
    """A DFlash drafter: its layer stack (a ModelConfig) plus the block and tap settings."""

    layers: ModelConfig
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "DrafterConfig":
        archs = raw.get("architectures") or []
        if "DFlashDraftModel" not in archs:
            raise ConfigError(f"{source}: not a DFlash drafter (architectures={archs}, expected ['DFlashDraftModel'])")
        dflash = raw.get("dflash_config") or {}
        block_size = raw.get("block_size", dflash.get("block_size"))
        if block_size is None:
            raise ConfigError(f"{source}: missing block_size (top level or inside dflash_config)")
        if "mask_token_id" not in dflash:
            raise ConfigError(f"{source}: missing dflash_config.mask_token_id")
        layers = ModelConfig.from_dict(raw, source)
        n_target = raw.get("num_target_layers")
        tap_ids = dflash.get("target_layer_ids")
        if tap_ids is None:
            if n_target is None:
                raise ConfigError(f"{source}: neither dflash_config.target_layer_ids nor num_target_layers given")
            tap_ids = default_tap_ids(int(n_target), layers.num_hidden_layers)
        if int(block_size) < 2:
            raise ConfigError(f"{source}: block_size must be >= 2, got {block_size}")
        return cls(layers=layers, block_size=int(block_size), mask_token_id=int(dflash["mask_token_id"]),
                   target_layer_ids=[int(i) for i in tap_ids],
                   num_target_layers=int(n_target) if n_target is not None else None)

    @classmethod
    def from_file(cls, path: Path) -> "DrafterConfig":
        return cls.from_dict(read_json(path), source=str(path))

    def check_fits(self, target, source: Path | str) -> None:
        """Refuse a drafter that cannot serve this target (its config: a ModelConfig or Gemma4Config): another
        hidden size, taps of layers it lacks, a mask token outside its embedding."""
        c = self.layers
        if c.hidden_size != target.hidden_size:
            raise ConfigError(f"{source}: drafter hidden_size {c.hidden_size} != target hidden_size "
                              f"{target.hidden_size}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            raise ConfigError(f"{source}: target_layer_ids {bad} out of range for a target with "
                              f"{target.num_hidden_layers} layers")
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ConfigError(f"{source}: mask_token_id {self.mask_token_id} is not a row of the target's "
                              f"embedding (vocab_size {target.vocab_size})")

    def to_dict(self) -> dict[str, Any]:
        """The z-lab config.json layout."""
        c = self.layers
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": c.model_type,
            "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": self.target_layer_ids},
            "num_target_layers": self.num_target_layers,
            "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim,
            "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta,
            "max_position_embeddings": c.max_position_embeddings,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "layer_types": ["full_attention"] * c.num_hidden_layers,
        }


def default_tap_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default: the middle layer for one draft layer, else evenly spaced from 1 to N-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    k = num_draft_layers
    return [round(1 + i * (num_target_layers - 4) / (k - 1)) for i in range(k)]


CONSTRAINT_KINDS = ("json_object", "json_schema", "gbnf", "regex")


@dataclass(frozen=True)
class Constraint:
    """Output restricted by a grammar: any JSON object, JSON matching a schema (source: the schema as JSON text),
    a GBNF grammar (llama.cpp's `grammar` field) or a regular expression."""

    kind: str
    source: str = ""

    def validate(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}, got {self.kind!r}")
        if self.kind != "json_object" and not self.source:
            raise ValueError(f"a {self.kind} constraint needs its source text")


@dataclass
class SamplingParams:
    """Per-request sampling. temperature 0 is greedy. Warping order: temperature, top-k, top-p, min-p (as HF and vLLM).

    Before warping, the target's logits at each position are processed in this order: logit_bias added; repeat
    penalty (llama.cpp's: positive logits divided, negative multiplied, for tokens among the last repeat_last_n
    of prompt and output); presence and frequency penalties (OpenAI's: over the generated tokens); the constraint's
    grammar mask. Each position's processing depends only on the tokens committed before it, so drafting cannot
    change the output. logprobs: None for none, k >= 0 for each emitted token's log-probability under the target
    (log-softmax of its raw logits) and the k most likely alternatives."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    constraint: Constraint | None = None
    logprobs: int | None = None

    def validate(self) -> None:
        if not (self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be a non-negative integer below 2**63, got {self.seed}")
        if not (self.repeat_penalty > 0):
            raise ValueError(f"repeat_penalty must be > 0 (1 disables it), got {self.repeat_penalty}")
        if self.repeat_last_n < -1:
            raise ValueError(f"repeat_last_n must be >= -1 (-1: the whole context), got {self.repeat_last_n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2.0 <= getattr(self, name) <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.constraint is not None:
            self.constraint.validate()
            if self.ignore_eos:  # a complete output can only be followed by an end of sequence
                raise ValueError("ignore_eos cannot be combined with a grammar constraint (json_schema, "
                                 "response_format, grammar): the grammar's end is the end of the output")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {token!r}")
            if not math.isfinite(bias):
                raise ValueError(f"logit_bias[{token}] must be a finite number, got {bias}")

    @property
    def processes_logits(self) -> bool:
        """Whether any logit processing (bias, penalties, grammar) applies before sampling."""
        return bool(self.logit_bias or self.repeat_penalty != 1.0 or self.presence_penalty
                    or self.frequency_penalty or self.constraint is not None)

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one so small that sampling is greedy decoding (GREEDY_BELOW): every path, the
        graphed greedy step included, then picks the argmax."""
        return self.temperature < GREEDY_BELOW


def read_json(path: Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"missing file: {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from e


def as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def is_gguf_path(path) -> bool:
    """A llama.cpp GGUF file rather than a Hugging Face folder (decided by name; kept torch-free for the server)."""
    return path is not None and str(path).lower().endswith(".gguf")
