"""Tokenizer and chat template of a model folder (transformers is used for these only)."""
from __future__ import annotations

import logging
from pathlib import Path

from flashdraft.config import ConfigError


class Tokenizer:
    def __init__(self, folder: str | Path):
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
            raise ConfigError(f"{folder} has no tokenizer (tokenizer.json / tokenizer_config.json)")
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        logging.getLogger("transformers").setLevel(logging.ERROR)
        try:
            self.hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as e:  # transformers raises many types for unusable tokenizer files
            raise ConfigError(f"{folder}: cannot load tokenizer ({type(e).__name__}: {e})") from e

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def special_tokens(self) -> dict[str, str]:
        """The special tokens chat templates see by name (bos_token, eos_token, ...), as transformers passes them."""
        return {k: v for k, v in self.hf.special_tokens_map.items() if isinstance(v, str)}

    def template_input_names(self) -> set[str]:
        """Names a template keyword argument must not take: apply_chat_template's own parameters (chat_template,
        tokenize, ...) and what it passes the template itself (messages, the special tokens)."""
        import inspect

        params = inspect.signature(type(self.hf).apply_chat_template).parameters.values()
        own = {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        return own | {"messages", "add_generation_prompt", "tools", "documents"} | set(self.hf.special_tokens_map)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict], **template_kwargs) -> str:
        """The chat template applied to messages, with the generation prompt added."""
        if not self.chat_template:
            raise ConfigError("this model's tokenizer has no chat template; send a raw prompt instead")
        messages = normalize_messages(messages)
        try:
            return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                               **template_kwargs)
        except Exception as e:  # a template may raise_exception() on inputs it rejects
            raise ValueError(f"chat template failed: {e}") from e

    def encode_chat(self, messages: list[dict], **template_kwargs) -> list[int]:
        # The template writes any BOS itself, so the tokenizer must not add another.
        return self.encode(self.render_chat(messages, **template_kwargs), add_special_tokens=False)


def normalize_messages(messages) -> list[dict]:
    """Check chat messages and flatten OpenAI text-part lists into plain strings (templates expect strings)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}].role must be a string")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ValueError(f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        out.append({**m, "content": content if content is not None else ""})
    return out
