"""Tiny random checkpoints in Hugging Face layout, built by the tests themselves (nothing is downloaded)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "The quick brown fox jumps over the lazy dog.\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    main()\n",
    "Hello, world! Speculative decoding drafts a block and verifies it.\n",
]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(folder: Path, vocab_size: int = 384) -> int:
    """A byte-level BPE tokenizer with a chat template; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return tok.get_vocab_size()


def special_id(folder: Path, content: str) -> int:
    added = json.loads((Path(folder) / "tokenizer.json").read_text())["added_tokens"]
    return next(t["id"] for t in added if t["content"] == content)


def build_target(folder: Path, family: str = "qwen3", layers: int = 4, hidden: int = 64, seed: int = 0,
                 shard: bool = False, init_std: float = 0.08, max_positions: int = 512) -> Path:
    """A random tiny Qwen3 or Llama checkpoint saved by transformers (the reference implementation)."""
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(folder)
    eos = special_id(folder, "<|im_end|>")
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                  rms_norm_eps=1e-6, initializer_range=init_std, tie_word_embeddings=False, eos_token_id=eos,
                  bos_token_id=None)
    torch.manual_seed(seed)
    if family == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=hidden // 4, rope_theta=10000.0, **common)
        model = transformers.Qwen3ForCausalLM(cfg)
    elif family == "llama":
        cfg = transformers.LlamaConfig(
            rope_theta=500000.0, **common,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64})
        model = transformers.LlamaForCausalLM(cfg)
    else:
        raise ValueError(family)
    model.save_pretrained(str(folder), max_shard_size="60KB" if shard else "2GB")
    return folder


def build_drafter(folder: Path, target: Path, layers: int = 2, block_size: int = 8, seed: int = 1,
                  tap_ids: list[int] | None = None, init_std: float = 0.08) -> Path:
    """A random DFlash drafter in z-lab's exact layout (config.json + model.safetensors, no embedding/head)."""
    from flashdraft.config import DrafterConfig
    from flashdraft.models import DFlashDrafter

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tcfg = json.loads((target / "config.json").read_text())
    mask_id = special_id(target, "<|mask|>")
    raw = {k: tcfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                                "num_key_value_heads", "rms_norm_eps", "max_position_embeddings")}
    raw.update(model_type="qwen3", architectures=["DFlashDraftModel"], num_hidden_layers=layers,
               head_dim=tcfg["hidden_size"] // tcfg["num_attention_heads"], rope_theta=10000.0,
               block_size=block_size, num_target_layers=tcfg["num_hidden_layers"],
               dflash_config={"mask_token_id": mask_id,
                              "target_layer_ids": tap_ids or [1, tcfg["num_hidden_layers"] - 2]})
    cfg = DrafterConfig.from_dict(raw)
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg, max_positions=16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, init_std)
    (folder / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    return folder


# Chat templates with tools in the shape of three families' (Qwen3/Hermes, Llama 3.x, Gemma 4), for the server's
# tool-calling tests: tools rendered the family's way, past calls and tool results in the history.
QWEN3_TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}{% for tc in m.tool_calls or [] %}"
    "\n<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}}"
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
LLAMA3_TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    "You have access to the following functions. Respond with a JSON for a function call in the format "
    "{\"name\": function name, \"parameters\": dictionary of argument name and its value}.\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% for tc in m.tool_calls %}"
    "{\"name\": \"{{ tc.function.name }}\", \"parameters\": {{ tc.function.arguments | tojson }}}{% endfor %}<|eot_id|>"
    "{% elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
GEMMA4_TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools or messages[0].role == 'system' %}<|turn>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}{% for t in tools or [] %}"
    "<|tool>declaration:{{ t.function.name }}{description:<|\"|>{{ t.function.description }}<|\"|>,parameters:"
    "{{ t.function.parameters | tojson }}}<tool|>{% endfor %}<turn|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'system' %}"
    "{% elif m.role == 'tool' %}<|turn>user\n<|tool_response>response:{{ m.name or 'tool' }}{{ m.content }}"
    "<tool_response|><turn|>\n"
    "{% elif m.role == 'assistant' %}<|turn>model\n{% for tc in m.tool_calls or [] %}<|tool_call>call:"
    "{{ tc.function.name }}{{ tc.function.arguments | tojson }}<tool_call|>{% endfor %}{{ m.content }}<turn|>\n"
    "{% else %}<|turn>{{ m.role }}\n{{ m.content }}<turn|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% if not enable_thinking %}<|channel>thought\n<channel|>{% endif %}"
    "{% endif %}"
)
TOOLS_TEMPLATES = {
    "qwen3": (QWEN3_TOOLS_TEMPLATE, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>", None),
    "llama3": (LLAMA3_TOOLS_TEMPLATE, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                                       "<|python_tag|>"], "<|eot_id|>", "<|begin_of_text|>"),
    "gemma4": (GEMMA4_TOOLS_TEMPLATE, ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|tool>", "<tool|>",
                                       "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>',
                                       "<|channel>", "<channel|>"], "<turn|>", "<bos>"),
}


def build_tools_tokenizer(folder: Path, family: str) -> Path:
    """A tokenizer (no model) with a tools-aware chat template of the family: qwen3, llama3 or gemma4."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    template, specials, eos, bos = TOOLS_TEMPLATES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos, pad_token=specials[0])
    fast.chat_template = template
    Path(folder).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return Path(folder)
