"""The docs site builds strict (``make docs``), its generated pages name everything, and a broken link fails it.

The build runs ``mkdocs build --strict`` on mkdocs.yml into a temporary folder: any warning (a link to a missing
page or heading, an absolute link, a page the nav leaves out, a nav entry without its page) fails it. The two
generated pages (scripts/docs/reference_pages.py) are checked against the code they are made from, so a generator
that drops a command, an option or a setting fails here. The build with planted faults shows that strict mode
catches each kind of fault the site config promises to catch.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from scripts.docs import reference_pages

ROOT = Path(__file__).resolve().parent.parent


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"), "-d", str(site)],
        cwd=root,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def warnings(output: str) -> list[str]:
    """MkDocs' warnings in ``output``, each with its continuation lines."""
    return [record for record in re.split(r"\n(?=[A-Z]+ +- )", output) if record.startswith("WARNING")]


def nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in nav_pages(value)]
    return [page for item in nav for page in nav_pages(item)]


def test_site_builds_strict(tmp_path):
    done = build(ROOT, tmp_path / "site")
    assert done.returncode == 0, "the docs site does not build (make docs):\n" + "\n".join(warnings(done.stderr))
    for page in ("reference/cli/index.html", "reference/settings/index.html", "lineage.png"):
        assert (tmp_path / "site" / page).is_file(), page


def test_cli_page_names_every_command_and_option():
    import ft_assets.cli
    from ft_assets.cli.parser import build_parser

    page = reference_pages.cli_page()
    sections = dict(re.findall(r"^## ft-assets (\S+)\n(.*?)(?=^## |\Z)", page, re.M | re.S))
    commands = list(reference_pages.subcommands(build_parser(ft_assets.cli.__doc__)))
    assert [name for name, _, _ in commands] == list(sections), "each command has its section, in the parser's order"
    for name, command, _ in commands:
        for action in command._actions:
            for option in action.option_strings or [action.dest]:
                if option not in ("-h", "--help"):
                    assert f"`{option}`" in sections[name], f"ft-assets {name} {option} is missing from the CLI page"


def setting_sections(page: str) -> dict[str, str]:
    """Heading id -> the section's text, for every ``### name {#id}`` and ``#### name {#id}``."""
    return dict(re.findall(r"^#{3,4} \S+ \{#([\w.]+)\}\n(.*?)(?=^#{2,4} |\Z)", page, re.M | re.S))


def test_settings_page_names_every_setting():
    from ft_assets.definitions import defs
    from ft_assets.training.config import TrainingConfig

    sections = setting_sections(reference_pages.settings_page())

    def names_every_field(anchor: str, model: type[BaseModel]) -> None:
        assert anchor in sections, f"no section #{anchor} on the settings page"
        for name, field in reference_pages.settable_fields(model).items():
            assert f"| `{name}` |" in sections[anchor], f"{anchor}: setting {name} is missing"
            inner = reference_pages.nested_model(field.annotation)
            if inner is not None:
                names_every_field(f"{anchor}.{name}", inner)

    names_every_field("lora_adapter", TrainingConfig)
    for key, assets_def in defs.get_repository_def().assets_defs_by_key.items():
        model = reference_pages.config_class(assets_def)
        if model is not None:
            names_every_field(key.to_user_string(), model)
    for name, resource in defs.resources.items():
        if reference_pages.settable_fields(type(resource)):
            names_every_field(f"resources.{name}", type(resource))


# Each fault planted in the home page or the nav of a copy of the site, and what the warning names.
FAULTS = [
    ("a link to a missing page", "[x](no-such-page.md)", "no-such-page.md"),
    ("a link to a missing heading", "[x](reference/settings.md#no-such-setting)", "#no-such-setting"),
    ("an absolute link", "[x](/guides/data.md)", "/guides/data.md"),
    ("a link that is no page or file", "[x](guides/)", "'guides/'"),
]


def test_broken_links_fail_the_build(tmp_path):
    """A copy of the site, one nav page removed, one page outside the nav, and one broken link of each kind."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path)
    shutil.copytree(ROOT / "scripts" / "docs", tmp_path / "scripts" / "docs")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    generated = {reference_pages.CLI_PAGE, reference_pages.SETTINGS_PAGE}
    left_out = "concepts.md"  # a nav entry without its page
    assert left_out in set(nav_pages(config["nav"])) - generated
    (tmp_path / "docs" / left_out).unlink()
    (tmp_path / "docs" / "orphan.md").write_text("# A page the nav does not list\n")
    home = tmp_path / "docs" / "index.md"
    home.write_text(home.read_text() + "\n" + "\n\n".join(link for _, link, _ in FAULTS) + "\n")

    done = build(tmp_path, tmp_path / "site")
    assert done.returncode != 0, "a strict build with broken links passed"
    found = warnings(done.stderr)
    expected = [(what, named) for what, _, named in FAULTS]
    expected += [("a page not in the nav", "orphan.md"), ("a nav entry without its page", f"'{left_out}'")]
    for what, named in expected:
        assert any(named in warning for warning in found), f"{what} ({named}) gave no warning:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "help_text, cell",
    [
        ("<store>/registry/<name>", "&lt;store&gt;/registry/&lt;name&gt;"),
        ("a|b and x_y and *z*", r"a\|b and x\_y and \*z\*"),
        ("`keep_this|code` as is", "`keep_this|code` as is"),
        ("two\n   lines", "two lines"),
    ],
)
def test_help_text_is_escaped_for_a_table_cell(help_text, cell):
    assert reference_pages.text(help_text) == cell


BUILD_NOTES = (  # how the product was built, which its text must not say (measurements go to docs/validation/)
    r"\(#\d+\)",  # "(#16)": an issue of the tracker
    r"\bissues? #?\d+\b",
    r"\bshared cores\b",
    r"\bno GPU (?:was |is )?(?:lent|available)\b",
)


def product_text() -> dict[str, str]:
    """The README, the docs pages but the validation ones, the examples and every module of the package."""
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "examples").iterdir()]
    files += (ROOT / "ft_assets").rglob("*.py")
    validation = ROOT / "docs" / "validation"
    return {str(f.relative_to(ROOT)): f.read_text() for f in files if validation not in f.parents and f.is_file()}


def test_the_product_text_carries_no_build_notes():
    found = [
        f"{name}:{text.count(chr(10), 0, match.start()) + 1}: {match.group(0)!r}"
        for name, text in product_text().items()
        for pattern in BUILD_NOTES
        for match in re.finditer(pattern, text, re.IGNORECASE)
    ]
    assert found == []
    assert re.findall(BUILD_NOTES[0], "the key changed (#16), so") and re.findall(BUILD_NOTES[2], "on 2 shared cores")


def test_the_readme_is_a_front_door():
    """At most 250 lines, and each quickstart's commands in at most 15 lines."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    quickstarts = re.findall(r"^## Quickstart.*?\n```bash\n(.*?)```", readme, re.MULTILINE | re.DOTALL)
    assert len(quickstarts) == 3 and all(len(block.splitlines()) <= 15 for block in quickstarts), quickstarts
