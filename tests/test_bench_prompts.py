"""bench prompt sets: the built-in sets and JSONL files, bad lines named by number."""
import json

import pytest

from flashdraft.bench.prompts import BUILTIN, PromptError, load_jsonl, load_prompt_set


def test_builtin_sets():
    code = load_prompt_set("code")
    assert [p.name for p in code] == ["task-store", "kv-report", "linked-list"]
    assert code[2].messages[0]["content"].startswith("Write a complete Python doubly linked list module.")
    assert all(p.messages and p.messages[0]["role"] == "user" for p in code + load_prompt_set("prose"))
    conversation = load_prompt_set("multiturn")
    assert sum(p.cases for p in conversation) == len(conversation[0].turns) >= 3
    assert set(BUILTIN) == {"code", "prose", "multiturn", "agent"}
    (session,) = load_prompt_set("agent")
    assert "def total_value(self):" in session.turns[0] and "total_value" in session.turns[1]


def write(tmp_path, lines):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_forms_and_blank_lines(tmp_path):
    path = write(tmp_path, [
        json.dumps({"name": "raw", "prompt": "def f(x):"}),
        "",
        json.dumps({"name": "chat", "messages": [{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}),
        json.dumps({"name": "talk", "turns": ["one", "two"]}),
    ])
    raw, chat, talk = load_prompt_set(str(path))
    assert raw.prompt == "def f(x):" and raw.messages is None and raw.cases == 1
    assert chat.messages[1] == {"role": "user", "content": "Hi"}
    assert talk.turns == ["one", "two"] and talk.cases == 2


@pytest.mark.parametrize("bad, expected", [
    ('{"name": "x", "prompt": ', "invalid JSON"),
    ('["not", "an", "object"]', "expected a JSON object"),
    ('{"prompt": "no name"}', "'name' must be a non-empty string"),
    ('{"name": "x", "prompt": "a", "messages": []}', "exactly one of"),
    ('{"name": "x"}', "exactly one of"),
    ('{"name": "x", "promt": "typo"}', "unknown field(s) ['promt']"),
    ('{"name": "x", "prompt": ""}', "'prompt' must be a non-empty string"),
    ('{"name": "x", "messages": [{"content": "no role"}]}', "messages[0].role must be a string"),
    ('{"name": "x", "turns": []}', "'turns' must be a non-empty list"),
])
def test_bad_line_is_named_by_number(tmp_path, bad, expected):
    path = write(tmp_path, [json.dumps({"name": "ok", "prompt": "fine"}), "", bad])
    with pytest.raises(PromptError) as info:
        load_jsonl(path)
    assert f"{path}, line 3: " in str(info.value)
    assert expected in str(info.value)


def test_duplicate_names_empty_and_missing_files(tmp_path):
    dup = write(tmp_path, [json.dumps({"name": "a", "prompt": "x"}), json.dumps({"name": "a", "prompt": "y"})])
    with pytest.raises(PromptError, match="line 2: name 'a' already used on line 1"):
        load_jsonl(dup)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(PromptError, match="no prompts"):
        load_jsonl(empty)
    with pytest.raises(PromptError, match="neither a built-in set"):
        load_prompt_set(str(tmp_path / "missing.jsonl"))
