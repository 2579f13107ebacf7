"""Shared fixtures: tiny random checkpoints built once per test session."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import build_drafter, build_target  # noqa: E402

# The models here are tiny: one thread avoids oversubscribing the cores that test servers also use.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> Path:
    return build_target(tmp_path_factory.mktemp("qwen3"), family="qwen3")


@pytest.fixture(scope="session")
def qwen3_sharded_dir(tmp_path_factory) -> Path:
    return build_target(tmp_path_factory.mktemp("qwen3_sharded"), family="qwen3", shard=True, seed=3)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    return build_target(tmp_path_factory.mktemp("llama"), family="llama", seed=2)


@pytest.fixture(scope="session")
def drafter_dir(tmp_path_factory, qwen3_dir) -> Path:
    """A random drafter (block size 8) for qwen3_dir."""
    return build_drafter(tmp_path_factory.mktemp("drafter"), qwen3_dir, block_size=8)


@pytest.fixture(scope="session")
def engine(qwen3_dir, drafter_dir):
    """Tiny Qwen3 target + random drafter, CPU float32, context 256."""
    from flashdraft.engine.generator import Engine
    return Engine.load(qwen3_dir, drafter_dir, device="cpu", context_size=256)


@pytest.fixture(autouse=True)
def fresh_dynamo_on_gpu():
    """On a GPU machine each test starts with no compiled graphs: the engine compiles its layers there, and one
    process building many tests' models would otherwise reach dynamo's recompile limit (which compile_layers turns
    into an error) in whichever test comes late. The CPU engine compiles nothing by default."""
    if torch.cuda.is_available():
        torch._dynamo.reset()
    yield


@pytest.fixture
def record_values_apart(monkeypatch):
    """record(module): module.qkv_prep wrapped so that each call appends whether it was handed its values apart
    (v=); returns that list."""
    def record(module) -> list[bool]:
        calls, real = [], module.qkv_prep

        def recording(*args, v=None, **kwargs):
            calls.append(v is not None)
            return real(*args, v=v, **kwargs)

        monkeypatch.setattr(module, "qkv_prep", recording)
        return calls

    return record
