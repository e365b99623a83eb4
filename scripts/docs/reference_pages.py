"""The docs' two generated pages: reference/cli.md (every command and option) and reference/settings.md (every setting).

A MkDocs hook (mkdocs.yml ``hooks:``): each build renders both pages from the code, the command line from
``ft_assets.cli.parser.build_parser`` (argparse's own actions, not ``--help`` text) and the settings from the
pydantic models the assets and resources of ``ft_assets.definitions`` take, and adds them to the site in memory.
They cannot drift from the code, and nothing generated is written to docs/ or committed. A hook rather than the
mkdocs-gen-files plugin: MkDocs 1.6 builds in-memory pages itself (``File.generated``), so one file here does it
without another dependency.

The settings are found from the definitions, not from a list: every asset of every plane job, the config class
its function takes, and every resource. An asset or field added to the code shows up on the next build.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
from collections.abc import Iterator
from types import NoneType, UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel

CLI_PAGE = "reference/cli.md"
SETTINGS_PAGE = "reference/settings.md"
PLANE_TITLES = {"data": "Data plane", "training": "Training plane", "delivery": "Delivery plane"}
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)


def on_files(files, config):
    """MkDocs event: add the generated pages to the build (nothing is written to docs/)."""
    from mkdocs.structure.files import File

    for page, render in ((CLI_PAGE, cli_page), (SETTINGS_PAGE, settings_page)):
        files.append(File.generated(config, page, content=render()))
    return files


def text(value: str) -> str:
    """``value`` as Markdown text in a table cell: its code spans kept, Markdown and HTML characters escaped elsewhere."""
    out, start = [], 0
    for span in CODE_SPAN.finditer(value):
        out += [_escape(value[start : span.start()]), span.group(0)]
        start = span.end()
    out.append(_escape(value[start:]))
    return " ".join("".join(out).split())


def _escape(value: str) -> str:
    value = value.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return re.sub(r"([\\*_\[\]|])", r"\\\1", value)


def sentence(value: str) -> str:
    """A help text as the start of a sentence: its first letter upper-case."""
    return value[:1].upper() + value[1:]


def code(value: str) -> str:
    fence = "``" if "`" in value else "`"
    return f"{fence}{value}{fence}"


# The command line ---------------------------------------------------------------------------------------------------


def cli_page() -> str:
    import ft_assets.cli
    from ft_assets.cli.parser import build_parser

    parser = build_parser(ft_assets.cli.__doc__.split("\n")[0])
    lines = [
        "# Command line",
        "",
        text(parser.description),
        "",
        f"```\n{parser.format_usage().strip()}\n```",
        "",
        "Every command answers `--help`. A mistyped command or option is refused with the usage line and exit "
        "status 2.",
    ]
    for name, command, help_text in subcommands(parser):
        lines += ["", f"## ft-assets {name}", "", text(sentence(help_text)) + ".", ""]
        lines += [f"```\n{command.format_usage().strip()}\n```", ""]
        lines += ["| Option | Value | Default | Description |", "|---|---|---|---|"]
        lines += [option_row(action) for action in command._actions if not isinstance(action, argparse._HelpAction)]
    return "\n".join(lines) + "\n"


def subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser, str]]:
    """(name, parser, help) of each subcommand, in the parser's order."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, command in action.choices.items():
                yield name, command, helps.get(name) or ""


def option_row(action: argparse.Action) -> str:
    names = ", ".join(code(name) for name in action.option_strings) or code(action.dest)
    if action.nargs == 0:
        value = "flag"
    elif action.choices:
        value = "one of " + ", ".join(code(str(choice)) for choice in action.choices)
    else:
        value = code(action.metavar or (action.dest if not action.option_strings else action.dest.upper()))
        value += {int: " (integer)", float: " (number)"}.get(action.type, "")
    if action.required or not action.option_strings:
        default = "required"
    elif action.nargs == 0 or action.default is None:
        default = ""
    else:
        default = code(str(action.default))
    return f"| {names} | {value} | {default} | {text(sentence(action.help or ''))} |"


# The settings -------------------------------------------------------------------------------------------------------


def settings_page() -> str:
    from ft_assets.control.jobs import PLANE_JOBS
    from ft_assets.definitions import defs
    from ft_assets.training.config import TrainingConfig
    from ft_assets.training.settings import TrainingSettings

    # lora_adapter's launchpad config mirrors TrainingConfig with its choices as plain strings (Dagster config has no
    # Literal); the page documents the model that validates them.
    documented = {TrainingSettings: TrainingConfig}
    repo = defs.get_repository_def()
    assets = {key.to_user_string(): assets_def for key, assets_def in repo.assets_defs_by_key.items()}
    lines = [
        "# Settings",
        "",
        "Every setting of every asset and resource, with its type, default and help text (the same text the Dagster "
        "launchpad shows). Set an asset's settings in a run config (`ft-assets run --config run.yaml`, or the "
        "launchpad) under `ops.<asset>.config`, a resource's under `resources.<resource>.config`:",
        "",
        "```yaml\nops:\n  lora_adapter:\n    config:\n      lora_r: 32\n      dpo: {beta: 0.2}\n"
        "resources:\n  data_executor:\n    config:\n      workers: 4\n```",
        "",
        "A setting left out takes its default. *Empty* in a description means the setting left unset "
        '(`null`, or `""` for text).',
    ]
    order = [key.to_user_string() for key in repo.asset_graph.toposorted_asset_keys]  # each plane in run order
    placed: set[str] = set()
    for job in PLANE_JOBS:
        plane = job.tags["ft/plane"]
        names = {key.to_user_string() for key in job.selection.resolve(repo.asset_graph)}
        placed |= names
        lines += ["", f"## {PLANE_TITLES.get(plane, plane.capitalize())}", "", f"The assets of the `{job.name}` job."]
        without = []
        for name in sorted(names, key=order.index):
            model = config_class(assets[name])
            if model is None:
                without.append(name)
                continue
            lines += ["", f"### {name} {{#{name}}}", "", text(first_paragraph(assets[name]))]
            lines += model_section(documented.get(model, model), name, f"ops.{name}.config", with_doc=False)
        if without:
            lines += ["", "Without settings: " + ", ".join(code(name) for name in without) + "."]
    unplaced = sorted(set(assets) - placed)
    if unplaced:
        raise ValueError(f"assets in no plane job (ft_assets/control/jobs.py): {unplaced}")
    lines += ["", "## Resources", "", "Shared by the assets of every plane; set once per run."]
    for name, resource in defs.resources.items():
        if settable_fields(type(resource)):
            lines += ["", f"### {name} {{#resources.{name}}}"]
            lines += model_section(type(resource), f"resources.{name}", f"resources.{name}.config")
    return "\n".join(lines) + "\n"


def config_class(assets_def) -> type[BaseModel] | None:
    """The Config class the asset's function takes (Dagster passes it as the parameter named ``config``), or None."""
    function = getattr(assets_def.op.compute_fn, "decorated_fn", assets_def.op.compute_fn)
    parameter = inspect.signature(function, eval_str=True).parameters.get("config")
    return None if parameter is None else parameter.annotation


def first_paragraph(assets_def) -> str:
    """The first paragraph of the asset's description (its docstring)."""
    description = next(iter(assets_def.descriptions_by_key.values()), None) or ""
    return " ".join(description.strip().split("\n\n")[0].split())


def settable_fields(model: type[BaseModel]) -> dict:
    """The model's fields a user sets (a resource's dependencies on other resources are not settings)."""
    return {name: field for name, field in model.model_fields.items() if "resource_dependency" not in field.metadata}


def model_section(model: type[BaseModel], anchor: str, where: str, with_doc: bool = True) -> list[str]:
    """A table of ``model``'s fields (after its docstring's first paragraph), then a subsection for each nested model."""
    lines = []
    if with_doc and model.__doc__:
        lines += ["", text(inspect.cleandoc(model.__doc__).split("\n\n")[0])]
    lines += ["", f"Set under `{where}`.", "", "| Setting | Type | Default | Description |", "|---|---|---|---|"]
    nested = []
    for name, field in settable_fields(model).items():
        inner = nested_model(field.annotation)
        if inner is not None:
            nested.append((name, inner))
            kind, default = f"[{inner.__name__}](#{anchor}.{name})", "see below"
        else:
            kind, default = type_text(field.annotation, field.metadata), default_text(field)
        lines.append(f"| {code(name)} | {kind} | {default} | {text(field.description or '')} |")
    for name, inner in nested:
        lines += ["", f"#### {anchor.rpartition('.')[2]}.{name} {{#{anchor}.{name}}}"]
        lines += model_section(inner, f"{anchor}.{name}", f"{where}.{name}")
    return lines


def nested_model(annotation) -> type[BaseModel] | None:
    args = [arg for arg in get_args(annotation) if arg is not NoneType] if is_union(annotation) else [annotation]
    if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel) and settable_fields(args[0]):
        return args[0]
    return None


def is_union(annotation) -> bool:
    return get_origin(annotation) in (Union, UnionType)


BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}  # annotated_types' bounds on a field, as the page writes them


def type_text(annotation, metadata: list | tuple = ()) -> str:
    """A field's type in words: ``int``, one of ``a``, ``b``, ``float`` (>= 0) or empty."""
    if is_union(annotation):
        args = get_args(annotation)
        shown = " or ".join(type_text(arg) for arg in args if arg is not NoneType)
        kind = shown + (" or empty" if NoneType in args else "")
    elif get_origin(annotation) is Literal:
        kind = "one of " + ", ".join(code(str(value)) for value in get_args(annotation))
    elif isinstance(annotation, type) and get_origin(annotation) is None:
        kind = code(annotation.__name__)
    else:
        kind = code(re.sub(r"\b[\w.]+\.(\w+)", r"\1", str(annotation)))
    bounds = [f"{BOUNDS[key]} {value}" for item in metadata for key, value in _bounds(item)]
    return kind + (f" ({', '.join(bounds)})" if bounds else "")


def _bounds(item: Any) -> Iterator[tuple[str, Any]]:
    for key in BOUNDS:
        if getattr(item, key, None) is not None:
            yield key, getattr(item, key)


def default_text(field) -> str:
    """The default as a run config writes it (JSON is YAML): ``null``, ``"NFC"``, ``[]``, ``0.05``."""
    value = field.get_default(call_default_factory=True)
    return code(json.dumps(value.model_dump() if isinstance(value, BaseModel) else value, default=str))
