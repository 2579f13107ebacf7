"""What `flashdraft serve` was asked to do, once its flags are parsed."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerSettings:
    model: str
    drafter: str | None
    alias: str | None                   # None: the engine's name
    host: str = "127.0.0.1"
    port: int = 8080
    ctx_size: int | None = None         # None = the model's (capped by the engine)
    n_slots: int = 1
    drafting: bool = True               # False with --spec-type none (or no drafter): plain decoding
    ngram: bool = False                 # --spec-type ngram: n-gram lookup, no drafter (dflash+ngram: beside one)
    # Request defaults (llama-server's flag defaults where flashdraft's differ are noted in docs/server.md).
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    n_predict: int = -1                 # -1 = until the context is full
    spec_n_max: int | None = None       # None = the drafter's block size - 1
    spec_n_min: int = 0
    adaptive_draft: bool = True         # False (--no-spec-dm-adaptive): always draft up to n_max
    api_keys: list[str] = field(default_factory=list)
    metrics: bool = False
    webui: bool = True
    chat_template: str | None = None    # overrides the tokenizer's (--chat-template, --chat-template-file)
    reasoning: str = "auto"             # --reasoning: on/off set the templates' enable_thinking, auto leaves it
    reasoning_format: str = "auto"      # --reasoning-format: none leaves thinking in content, else reasoning_content
    reasoning_budget: int = -1          # --reasoning-budget: -1 unlimited, 0 no thinking (enable_thinking=false)
    cache_options: dict[str, str | int | None] = field(default_factory=dict)  # -ctk/-ctv/-ctkd/-ctvd/-cd: Engine.load keywords
    cache_ram_mib: int = 8192           # --cache-ram: host memory for prefixes the slots evict (0 off, -1 no limit)
    context_shift: bool = False         # --context-shift: a full context drops old tokens instead of ending
    warmup: bool = True                 # --no-warmup: no short generation per slot at load (Engine.warm_up)
    keep: int = 0                       # --keep: prompt tokens a context shift keeps (-1: all); requests' n_keep
    device: str | None = None
    threads: int | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    allow_request_template: bool = False  # --allow-request-chat-template: requests may send a chat template
    template_seconds: float = 0.5       # the time limit of rendering one request template
