"""Benchmark prompts: the built-in sets (code, prose, multiturn) and JSONL files.

A prompt is raw text (no chat template), a list of chat messages, or the user turns of a conversation that
grows turn by turn: each turn is benchmarked on the conversation so far, with the model's own replies fed
back as the assistant turns.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from flashdraft.loading.tokenizer import normalize_messages


class PromptError(ValueError):
    """A prompt set or prompt file that cannot be used; the message names the problem (and the line)."""


@dataclass(frozen=True)
class BenchPrompt:
    name: str
    prompt: str | None = None            # raw text, tokenized as is
    messages: list[dict] | None = None   # chat messages, through the model's chat template
    turns: list[str] | None = None       # user turns of a growing conversation

    @property
    def cases(self) -> int:
        """Rows this prompt contributes to the report (one per turn for a conversation)."""
        return len(self.turns) if self.turns else 1


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# The published BeeLlama/DFlash walkthrough's prompts (run there with max_tokens 1200, temperature 0.7).
CODE = [
    BenchPrompt("task-store", messages=user(
        "Write a complete Python task store module. Include a Task dataclass, TaskStatus enum, TaskStore class, "
        "add_task, update_task, delete_task, search_tasks, filter_by_status, export_to_json, get_all_tasks, and "
        "5 tests. Return only one complete Python file.")),
    BenchPrompt("kv-report", messages=user(
        "Write a complete Python key-value report module. Include a KeyValueStore class, set, get, delete, "
        "exists, list_keys, filter_by_prefix, export_to_json, load_from_json, and a generate_report function "
        "that returns total keys, empty values, prefix counts, and largest value length. Include 5 tests. "
        "Return only one complete Python file.")),
    BenchPrompt("linked-list", messages=user(
        "Write a complete Python doubly linked list module. Include a Node dataclass, DoublyLinkedList class, "
        "append, prepend, delete, find, reverse, to_list, from_list, clear, and 5 tests. Return only one "
        "complete Python file.")),
]

# Free prose: less predictable than code, so drafting is expected to pay less.
PROSE = [
    BenchPrompt("moe-blog", messages=user(
        "Write a blog post of about 600 words explaining Mixture of Experts language models to software "
        "engineers: what an expert and a router are, why only a few experts run per token, and what that "
        "means for memory and speed.")),
    BenchPrompt("travel-story", messages=user(
        "Write a short travel story about a night train from Vienna to Venice: the people in the compartment, "
        "the view at dawn over the Alps, and arriving at the lagoon.")),
    BenchPrompt("garden-letter", messages=user(
        "Write a friendly letter to a neighbour who is starting a vegetable garden, with advice on soil, "
        "what to plant first, watering, and dealing with slugs.")),
]

# A coding session: each turn builds on the model's previous answer (MT-Bench style).
MULTITURN = [
    BenchPrompt("session", turns=[
        "Write a Python function parse_log(path) that reads a web server access log and returns a list of "
        "dicts with ip, timestamp, method, path, status and size.",
        "Add a function top_paths(entries, n) that returns the n most requested paths with their counts, and "
        "make parse_log skip malformed lines instead of failing.",
        "Now write 5 pytest tests for parse_log and top_paths, using a temporary log file.",
        "Finally, add a command-line interface with argparse that prints the top paths as a table.",
    ]),
]

INVENTORY_PY = '''import json
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    quantity: int
    price: float


class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, quantity, price):
        if name in self.items:
            self.items[name].quantity += quantity
        else:
            self.items[name] = Item(name, quantity, price)

    def remove(self, name, quantity):
        item = self.items[name]
        if item.quantity < quantity:
            raise ValueError("not enough " + name)
        item.quantity -= quantity
        if item.quantity == 0:
            del self.items[name]

    def total_value(self):
        return sum(i.quantity * i.price for i in self.items.values())

    def save(self, path):
        with open(path, "w") as f:
            json.dump([vars(i) for i in self.items.values()], f)

    def load(self, path):
        with open(path) as f:
            for row in json.load(f):
                self.add(row["name"], row["quantity"], row["price"])
'''

# A coding agent's session: each turn quotes or edits code that is already in the conversation, so much of each
# answer copies its context (where prompt-lookup drafting pays, and where prefix reuse saves re-reading the file).
AGENT = [
    BenchPrompt("inventory-edits", turns=[
        "Here is inventory.py:\n\n```python\n" + INVENTORY_PY + "```\n\nAdd type hints to every method and "
        "return the whole file.",
        "Rename the method total_value to value everywhere and return the whole file again.",
        "Make remove raise KeyError with a clear message when the item does not exist, and return the whole "
        "file again.",
        "Write pytest tests for add, remove, value, save and load, quoting the class as it is now.",
    ]),
]

BUILTIN = {"code": CODE, "prose": PROSE, "multiturn": MULTITURN, "agent": AGENT}


def load_prompt_set(spec: str) -> list[BenchPrompt]:
    """A built-in set by name, or a JSONL file path."""
    if spec in BUILTIN:
        return list(BUILTIN[spec])
    path = Path(spec)
    if not path.is_file():
        raise PromptError(f"--prompts: {spec!r} is neither a built-in set ({', '.join(BUILTIN)}) nor a file")
    return load_jsonl(path)


FIELDS = {"name", "prompt", "messages", "turns"}


def load_jsonl(path: Path) -> list[BenchPrompt]:
    """One object a line: {"name", "prompt"} or {"name", "messages"} or {"name", "turns"}; blank lines skipped."""
    prompts: list[BenchPrompt] = []
    seen: dict[str, int] = {}
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PromptError(f"{path}: cannot read ({e})") from e
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            prompt = parse_line(line)
        except ValueError as e:
            raise PromptError(f"{path}, line {number}: {e}") from e
        if prompt.name in seen:
            raise PromptError(f"{path}, line {number}: name {prompt.name!r} already used on line {seen[prompt.name]}")
        seen[prompt.name] = number
        prompts.append(prompt)
    if not prompts:
        raise PromptError(f"{path}: no prompts (expected one JSON object a line)")
    return prompts


def parse_line(line: str) -> BenchPrompt:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON ({e.msg} at column {e.colno})") from e
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - FIELDS)
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}; allowed: {sorted(FIELDS)}")
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError("'name' must be a non-empty string")
    kinds = [k for k in ("prompt", "messages", "turns") if k in obj]
    if len(kinds) != 1:
        raise ValueError("give exactly one of 'prompt' (raw text), 'messages' (chat messages) or 'turns' "
                         f"(user turns of a conversation); got {kinds or 'none'}")
    kind, value = kinds[0], obj[kinds[0]]
    if kind == "prompt":
        if not isinstance(value, str) or not value:
            raise ValueError("'prompt' must be a non-empty string")
        return BenchPrompt(name, prompt=value)
    if kind == "messages":
        return BenchPrompt(name, messages=normalize_messages(value))
    if not isinstance(value, list) or not value or not all(isinstance(t, str) and t for t in value):
        raise ValueError("'turns' must be a non-empty list of non-empty strings (the user's turns)")
    return BenchPrompt(name, turns=list(value))
