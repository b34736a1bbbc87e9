"""docs/configuration.md documents every setting; CI runs the README's set-up commands."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel

from prefix_router.core.config import RouterConfig
from prefix_router.ops.up import ROUTING_SHORTCUTS, UpSettings

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text()


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


def settings_table() -> list[tuple[str, str]]:
    """(section, field) named in the first cell of each row of the routing settings
    table: ``a``, ``s.a``, and ``.b`` after ``s.a`` (another field of section ``s``); the
    flag and env var in parentheses are checked by the next test."""
    lines = CONFIGURATION.split("| setting | default | meaning |", 1)[1].splitlines()[2:]
    named = []
    for line in lines:
        if not line.startswith("|"):
            break
        section = ""
        for name in re.findall(r"`(\.?[a-z_0-9]+(?:\.[a-z_0-9]+)?)`", line.split("|")[1]):
            if name.startswith("."):
                assert section, line
                named.append((section, name[1:]))
            elif "." in name:
                section, field = name.split(".")
                named.append((section, field))
            else:
                named.append(("", name))
    return named


def test_the_settings_table_documents_every_routing_setting_and_no_other() -> None:
    documented = settings_table()
    assert len(documented) == len(set(documented)), "a setting has two rows"
    assert sorted(documented) == sorted(field_names(RouterConfig))


def test_every_up_setting_is_documented_with_its_flag_and_env_var() -> None:
    for name in [*UpSettings.model_fields, *ROUTING_SHORTCUTS]:
        assert f"--{name.replace('_', '-')}" in CONFIGURATION, name
        assert f"PREFIX_ROUTER_{name.upper()}" in CONFIGURATION, name


def test_ci_runs_the_readme_test_command() -> None:
    assert "make test" in README and "make run" in README
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == "make test"


def test_every_test_docs_testing_md_names_exists() -> None:
    """docs/testing.md maps each documented guarantee to a test: each named test exists."""
    text = (ROOT / "docs" / "testing.md").read_text()
    named = re.findall(r"`(test_\w+\.py)(?:::(test_\w+))?`", text)
    assert len(named) > 20
    for file, test in named:
        path = ROOT / "tests" / file
        assert path.exists(), file
        if test:
            assert re.search(rf"^(async )?def {test}\(", path.read_text(), re.M), (file, test)


def test_every_relative_link_in_the_docs_points_at_a_file() -> None:
    """README.md, docs/*.md and bench/README.md link to files that exist (anchors aside)."""
    pages = [ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
