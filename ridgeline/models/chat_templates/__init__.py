"""The chat templates `generator.chat_template.source=name` can name (SkyRL's names), one Jinja file each.

Written for Ridgeline after SkyRL's descriptions; unlike SkyRL's they end with the assistant header
when asked for a generation prompt, so a prompt rendered with them is the one the model answers."""

from __future__ import annotations

from pathlib import Path

__all__ = ["chat_template_names", "named_chat_template"]

_DIR = Path(__file__).resolve().parent


def chat_template_names() -> list[str]:
    return sorted(p.stem for p in _DIR.glob("*.jinja"))


def named_chat_template(name: str) -> str:
    """The template called ``name``; a name outside the library is a ValueError listing the names."""
    path = _DIR / f"{name}.jinja"
    if not path.is_file():
        raise ValueError(f"no chat template named {name!r}: the named templates are {', '.join(chat_template_names())}")
    return path.read_text()
