"""The README documents every setting, and its set-up commands are the ones CI runs."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from prefix_router.core.config import RouterConfig
from prefix_router.ops.up import ROUTING_SHORTCUTS, UpSettings

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def field_names(model: type[BaseModel]) -> list[tuple[str, str]]:
    """(section, field) for every leaf setting; section is '' at the top level."""
    out = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out += [(name, sub) for sub in annotation.model_fields]
        else:
            out.append(("", name))
    return out


def test_every_routing_setting_is_documented() -> None:
    for section, name in field_names(RouterConfig):
        assert f"`{section}.{name}`" in README or f".{name}`" in README or f"`{name}`" in README, (
            section,
            name,
        )


def test_every_up_setting_is_documented_with_its_flag_and_env_var() -> None:
    for name in [*UpSettings.model_fields, *ROUTING_SHORTCUTS]:
        assert f"--{name.replace('_', '-')}" in README, name
        assert f"PREFIX_ROUTER_{name.upper()}" in README, name


def test_ci_runs_the_readme_test_command() -> None:
    assert "make test" in README and "make run" in README
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == "make test"
