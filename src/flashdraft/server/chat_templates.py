"""Built-in chat templates for --chat-template NAME (llama-server's names), as Jinja strings.

For a model whose tokenizer has no template, or one to be replaced: --chat-template takes one of these names or
a Jinja template itself. They render no tools: a request's tools then go into a system message (formats.py).
"""
from __future__ import annotations

BUILTIN_TEMPLATES = {
    "chatml": (
        "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    ),
    "llama3": (
        "{{- bos_token -}}{%- for m in messages -%}"
        "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
        "{%- endif -%}"
    ),
    "gemma": (
        "{{- bos_token -}}{%- set system = messages[0]['content'] + '\\n\\n' if messages[0]['role'] == 'system' "
        "else '' -%}{%- for m in (messages[1:] if system else messages) -%}"
        "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' "
        "+ (system if loop.first else '') + m['content'] | trim + '<end_of_turn>\\n' }}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
    ),
    "mistral-v7": (
        "{{- bos_token -}}{%- for m in messages -%}"
        "{%- if m['role'] == 'system' -%}{{ '[SYSTEM_PROMPT]' + m['content'] + '[/SYSTEM_PROMPT]' }}"
        "{%- elif m['role'] == 'user' -%}{{ '[INST]' + m['content'] + '[/INST]' }}"
        "{%- else -%}{{ m['content'] + eos_token }}{%- endif -%}{%- endfor -%}"
    ),
}


def resolve_chat_template(value: str) -> str:
    """--chat-template's value: a built-in's name, else a Jinja template itself. Raises ValueError for a word that
    is neither."""
    if value in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[value]
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is not a built-in template ({', '.join(BUILTIN_TEMPLATES)}) "
                     "nor a Jinja template")
