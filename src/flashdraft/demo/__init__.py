"""The embedded demo pair: a small Python code model and its DFlash drafter, trained by scripts/demo/."""
from __future__ import annotations

from pathlib import Path

from flashdraft.config import ConfigError

DEMO_DIR = Path(__file__).parent
DEMO_NAME = "flashdraft-demo-code"  # the demo target's name in responses and /v1/models


def demo_paths() -> tuple[Path, Path | None]:
    target, drafter = DEMO_DIR / "target", DEMO_DIR / "drafter"
    if not (target / "config.json").is_file():
        raise ConfigError(f"the embedded demo model is missing ({target}); pass -m MODEL_FOLDER")
    return target, drafter if (drafter / "config.json").is_file() else None


def demo_name(model: str | Path) -> str | None:
    """DEMO_NAME for the embedded demo target's folder (or a file in it), None for any other model."""
    return DEMO_NAME if DEMO_DIR.resolve() in Path(model).resolve().parents else None
