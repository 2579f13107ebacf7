"""Tiny random Gemma 4 checkpoints and Gemma DFlash drafters, built by the tests (builders only, no tests here).

Targets are saved by transformers (the reference) in the published Gemma4ForConditionalGeneration layout
(text weights under model.language_model.), with every parameter randomised, including norms, router scales
and layer_scalar, so that no Gemma-specific detail can hide behind a default of one. The tokenizer puts Gemma's
special tokens at Gemma's ids (<eos> 1, <bos> 2, <mask> 4, <|tool_response> 50, <|turn> 105, <turn|> 106) and
carries a chat template with the structure of the 31B/26B template.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tiny_models import CORPUS

SPECIALS = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>", 46: "<|tool>", 47: "<tool|>",
            48: "<|tool_call>", 49: "<tool_call|>", 50: "<|tool_response>", 51: "<tool_response|>", 52: '<|"|>',
            98: "<|think|>", 100: "<|channel>", 101: "<channel|>", 105: "<|turn>", 106: "<turn|>"}
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set thinking = enable_thinking is defined and enable_thinking -%}"
    "{%- set has_system = messages[0]['role'] in ['system', 'developer'] -%}"
    "{%- if has_system or thinking -%}"
    "{{ '<|turn>system\\n' }}{%- if thinking -%}{{ '<|think|>\\n' }}{%- endif -%}"
    "{%- if has_system -%}{{ messages[0]['content'] | trim }}{%- endif -%}{{ '<turn|>\\n' }}"
    "{%- endif -%}"
    "{%- for m in (messages[1:] if has_system else messages) -%}"
    "{{ '<|turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' + (m['content'] | trim)"
    " + '<turn|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|turn>model\\n' }}"
    "{%- if not thinking -%}{{ '<|channel>thought\\n<channel|>' }}{%- endif -%}{%- endif -%}"
)

SLIDING, FULL = "sliding_attention", "full_attention"


def build_gemma_tokenizer(folder: Path, vocab_size: int = 512) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [SPECIALS.get(i, f"<unused{i}>") for i in range(max(SPECIALS) + 1)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", mask_token="<mask>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return tok.get_vocab_size()


def text_config(vocab: int, moe: bool, window: int = 8, layers: int = 6, max_positions: int = 512,
                head_dim: int = 16) -> dict:
    """A tiny Gemma4TextConfig in transformers' spelling: [S, S, F] repeated, full-layer heads twice as wide."""
    cfg = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
               num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, global_head_dim=2 * head_dim,
               num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=window,
               layer_types=[FULL if (i + 1) % 3 == 0 else SLIDING for i in range(layers)],
               final_logit_softcapping=3.0, hidden_size_per_layer_input=0, max_position_embeddings=max_positions,
               rms_norm_eps=1e-6, eos_token_id=[1, 106], bos_token_id=2, pad_token_id=0)
    if moe:
        cfg.update(enable_moe_block=True, num_experts=8, top_k_experts=3, moe_intermediate_size=24)
    return cfg


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Random values everywhere (norm weights around 1, layer_scalar away from 1) so every detail shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if not t.is_floating_point() or "inv_freq" in name or "embed_scale" in name:
                continue
            noise = torch.randn(t.shape, generator=g)
            if name.endswith("layer_scalar"):
                t.copy_(0.5 + torch.rand(t.shape, generator=g))
            elif "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
                t.copy_(1.0 + 0.3 * noise)
            else:
                t.copy_(0.15 * noise)


def build_gemma4_target(folder: Path, moe: bool = False, published_spelling: bool = True, seed: int = 0,
                        window: int = 8, layers: int = 6, head_dim: int = 16):
    """Save a random tiny Gemma 4 (dense or MoE) checkpoint; returns (folder, the transformers model). head_dim: the
    sliding layers' (the full layers' twice that); 32 or more for KV caches of block types."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = build_gemma_tokenizer(folder)
    cfg = Gemma4Config(text_config=text_config(vocab, moe, window, layers, head_dim=head_dim), vision_config=None,
                       audio_config=None)
    cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(cfg).eval()
    randomise(model, seed)
    model.save_pretrained(str(folder))
    raw = json.loads((folder / "config.json").read_text())
    if published_spelling:  # the published checkpoints' way of giving the full layers' shape
        text = raw["text_config"]
        del text["per_layer_config"]
        text.update(global_head_dim=2 * head_dim, num_global_key_value_heads=1)
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 2, "eos_token_id": [1, 106]}))
    return folder, model


def reference_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(input_ids=torch.tensor([ids])).logits[0].float()


def build_gemma_drafter(folder: Path, target: Path, layers: int = 3, block_size: int = 8, window: int = 6,
                        seed: int = 1, tap_ids: list[int] | None = None, **extra) -> Path:
    """A random drafter in z-lab's Gemma layout: model_type qwen3, [S..., F] layer_types, sliding_window,
    final_logit_softcapping, no embedding or head."""
    from flashdraft.models.gemma4.config import Gemma4DrafterConfig
    from flashdraft.models.gemma4.drafter import Gemma4DFlashDrafter

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    text = json.loads((target / "config.json").read_text())["text_config"]
    n_target = text["num_hidden_layers"]
    raw = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": text["vocab_size"],
           "hidden_size": text["hidden_size"], "intermediate_size": 128, "num_hidden_layers": layers,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
           "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 512, "block_size": block_size,
           "num_target_layers": n_target, "layer_types": [SLIDING] * (layers - 1) + [FULL],
           "sliding_window": window, "use_sliding_window": True, "final_logit_softcapping": 3.0,
           "dflash_config": {"mask_token_id": 4, "target_layer_ids": tap_ids or [1, n_target - 2]}}
    raw.update(extra)
    cfg = Gemma4DrafterConfig.from_dict(raw)
    torch.manual_seed(seed)
    model = Gemma4DFlashDrafter(cfg, max_positions=16)
    randomise(model, seed)
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    return folder
