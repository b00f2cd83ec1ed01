"""Generate the reference pages at build time (run by the mkdocs-gen-files plugin).

Two kinds of virtual pages, written with `mkdocs_gen_files` (nothing lands in `docs/` on disk):

- `reference/<package>/.../<module>.md`: one page per module of the four import packages, each holding a
  mkdocstrings `::: dotted.name` directive, plus `reference/SUMMARY.md` for mkdocs-literate-nav.
- `reference/config.md`: the configuration reference, read from the pydantic schema in
  `framework/config/schema.py` (types, defaults, constraints, descriptions) and from the Hydra tree in `conf/`
  (group options, and the values `mrv2 run` composes), so it always matches the code.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
from pathlib import Path
from typing import Any

import griffe
import mkdocs_gen_files
import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("framework", "model_states", "samplers", "speculators")
CONFIG_PAGE = "reference/config.md"

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# ---- API reference -------------------------------------------------------------------------------------


def _module_files(package: str) -> list[Path]:
    """Every public module of `package`, sorted by path (private `_x.py` modules and caches skipped)."""
    files = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT)
        if "__pycache__" in rel.parts or any(p.startswith("_") and p != "__init__.py" for p in rel.parts):
            continue
        files.append(rel)
    return files


def _summary(obj: griffe.Object | griffe.Alias) -> str:
    """First line of an object's docstring, for the public-API tables of package pages."""
    try:
        docstring = obj.docstring
    except griffe.AliasResolutionError:
        return ""
    lines = docstring.value.strip().splitlines() if docstring else []
    return lines[0] if lines else ""


def _package_page(package: griffe.Module, rendered: set[str]) -> str:
    """A package page: its docstring, then its `__all__` as a table linking to where each name is defined.

    The members themselves are rendered on their modules' pages only, so every object has one URL; a name
    defined outside the `rendered` modules (or private) is listed without a link.
    """
    lines = [f"::: {package.path}", "    options:", "      members: false", ""]
    public = package.exports or []
    if public:
        lines += ["## Public API", "", "| name | defined in | summary |", "|---|---|---|"]
        for name in public:
            member = package.get_member(str(name)) if str(name) in package.members else None
            if member is None:
                continue
            target = member.target_path if member.is_alias else member.path
            module, _, attr = target.rpartition(".")
            label = f"[`{name}`][{target}]" if module in rendered and not attr.startswith("_") else f"`{name}`"
            lines.append(f"| {label} | `{module}` | {_summary(member)} |")
        lines.append("")
    return "\n".join(lines)


def _dotted(rel: Path) -> str:
    parts = rel.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def write_api_pages(nav: mkdocs_gen_files.Nav) -> None:
    rendered = {_dotted(rel) for package in PACKAGES for rel in _module_files(package)}
    extensions = griffe.load_extensions(str(ROOT / "docs" / "griffe_comments.py"))  # as mkdocstrings does
    for package in PACKAGES:
        tree = griffe.load(package, search_paths=[str(ROOT)], extensions=extensions)
        for rel in _module_files(package):
            parts = rel.with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
                doc_path = Path("reference", *parts, "index.md")
            else:
                doc_path = Path("reference", *parts).with_suffix(".md")
            nav[parts] = doc_path.relative_to("reference").as_posix()
            with mkdocs_gen_files.open(doc_path, "w") as fd:
                if rel.name == "__init__.py":
                    fd.write(_package_page(tree[".".join(parts[1:])] if len(parts) > 1 else tree, rendered))
                else:
                    fd.write(f"::: {'.'.join(parts)}\n")
            mkdocs_gen_files.set_edit_path(doc_path, rel)


# ---- configuration reference ---------------------------------------------------------------------------

_JSON_TYPES = {"integer": "int", "number": "float", "string": "str", "boolean": "bool", "null": "null"}
_BOUNDS = (("minimum", ">= "), ("exclusiveMinimum", "> "), ("maximum", "<= "), ("exclusiveMaximum", "< "))


def _schema_type(prop: dict[str, Any]) -> str:
    """A JSON-schema property as a short type name: `int`, `str | null`, `list[str]`, `[int, int]`."""
    if "anyOf" in prop:
        return " | ".join(_schema_type(p) for p in prop["anyOf"])
    if "enum" in prop or "const" in prop:
        return _JSON_TYPES.get(prop.get("type", ""), "value")
    kind = prop.get("type")
    if kind == "array":
        if "prefixItems" in prop:
            return "[" + ", ".join(_schema_type(p) for p in prop["prefixItems"]) + "]"
        return f"list[{_schema_type(prop.get('items', {}))}]"
    if kind == "object":
        return "mapping"
    if "$ref" in prop:
        return prop["$ref"].rsplit("/", 1)[-1]
    return _JSON_TYPES.get(kind, kind or "any")


def _constraints(prop: dict[str, Any]) -> list[str]:
    """Allowed values and bounds of a property (looking inside `anyOf` and list items)."""
    out = []
    for key, op in _BOUNDS:
        if key in prop:
            out.append(f"{op}{prop[key]}")
    if "enum" in prop:
        out.append("one of " + ", ".join(f"`{v}`" for v in prop["enum"]))
    if "const" in prop:
        out.append(f"one of `{prop['const']}`")
    if "pattern" in prop:
        out.append(f"matches `{prop['pattern']}`")
    for sub in prop.get("anyOf", []):
        out += _constraints(sub)
    if "items" in prop and "prefixItems" not in prop:
        out += [f"items: {c}" for c in _constraints(prop["items"])]
    return out


def _json(value: Any) -> str:
    return f"`{json.dumps(value)}`"


def _default(field: Any) -> str:
    """The schema default of a field (what `load_config` and the `LLM` API use for a missing key)."""
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    return _json(value.model_dump(mode="json") if isinstance(value, BaseModel) else value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _field_table(model: type[BaseModel], prefix: str, composed: dict[str, Any], skip_groups: bool) -> list[str]:
    """One row per key: type and constraints from the JSON schema, defaults, description; a nested section
    (`speculator.dynamic`) gets one row per key of its own, not one for the whole section."""
    props = model.model_json_schema()["properties"]
    rows = [
        "| key | type | default | `mrv2 run` | constraints | description |",
        "|---|---|---|---|---|---|",
    ]
    for name, field in model.model_fields.items():
        section = _group_model(field)
        if section is not None:
            if not skip_groups:
                rows += _field_table(section, f"{prefix}{name}.", composed.get(name, {}), False)[2:]
            continue
        prop = props.get(field.alias or name, {})
        default = _default(field)
        run_value = _json(composed[name]) if name in composed else "-"
        rows.append(
            f"| `{prefix}{name}` | {_cell(_schema_type(prop))} | {_cell(default)} "
            f"| {'same' if run_value == default else _cell(run_value)} "
            f"| {_cell(', '.join(_constraints(prop)))} | {_cell(field.description or '')} |"
        )
    return rows


def _group_model(field: Any) -> type[BaseModel] | None:
    annotation = field.annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _yaml_comment(path: Path) -> str:
    """The leading comment of a YAML file, joined into one line (`# @package` directives skipped)."""
    words = []
    for line in path.read_text().splitlines():
        text = line.strip()
        if not text.startswith("#"):
            break
        if not text.startswith("# @"):
            words.append(text.lstrip("#").strip())
    return " ".join(words)


def _default_choices(conf: Path) -> dict[str, str]:
    """group -> option chosen by the defaults lists of the primary configs (`conf/*.yaml`)."""
    chosen: dict[str, str] = {}
    for primary in sorted(conf.glob("*.yaml")):
        for entry in (yaml.safe_load(primary.read_text()) or {}).get("defaults") or []:
            if isinstance(entry, dict):
                for group, option in entry.items():
                    if not group.startswith("override "):
                        chosen.setdefault(str(group), "null" if option is None else str(option))
    return chosen


def config_groups() -> list[str]:
    """The Hydra config groups under `conf/` and their options, with each file's first comment."""
    conf = ROOT / "conf"
    if not conf.is_dir():
        return []
    defaults = _default_choices(conf)
    rows = ["| group | option | description |", "|---|---|---|"]
    for group in sorted(p for p in conf.iterdir() if p.is_dir() and p.name not in ("hydra", "__pycache__")):
        for option in sorted(group.glob("*.yaml")):
            mark = " (default)" if defaults.get(group.name) == option.stem else ""
            rows.append(f"| `{group.name}` | `{option.stem}`{mark} | {_cell(_yaml_comment(option))} |")
    return [
        "## Config groups",
        "",
        "The options of each group under `conf/`; select one with `group=option`. An option's file holds only "
        "the keys where it differs from the schema's defaults. A group without a default option adds nothing "
        "unless one is selected.",
        "",
        *rows,
        "",
    ]


def composed_defaults(load_config: Any) -> dict[str, Any]:
    """The config `mrv2 run` gets without overrides: Hydra composes `conf/run.yaml`, pydantic validates it."""
    from hydra import compose, initialize_config_dir

    from framework.config.hydra_defaults import register_schema_defaults

    register_schema_defaults()  # `conf/base.yaml` composes the schema's defaults first
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="run")
    return load_config(cfg).model_dump(mode="json")


def config_reference() -> str:
    config = importlib.import_module("framework.config.schema")
    root: type[BaseModel] = config.Mrv2Config
    composed = composed_defaults(config.load_config) if (ROOT / "conf" / "run.yaml").is_file() else {}
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by docs/gen_ref_pages.py from framework/config/schema.py and conf/. -->",
        "",
        "Generated at build time from the pydantic schema in `framework/config/schema.py` "
        f"([`{root.__name__}`][framework.config.schema.{root.__name__}] and its sub-models) and from the YAML tree "
        "in `conf/`, so it always matches the code. See [Configuration](../configuration.md) for how groups, "
        "overrides and errors work.",
        "",
        "In the tables, *default* is the schema's default, used by `load_config` and the `LLM` API for a key "
        "that is not given, and the value Hydra starts from: `conf/` composes these defaults first and its group "
        "files set only the keys where an option differs (see [Configuration](../configuration.md#the-config-tree)). "
        "*`mrv2 run`* is the value the command composes from `conf/` without overrides (*same* when they agree).",
        "",
        *config_groups(),
        "## Top-level keys",
        "",
        _cell(inspect.getdoc(root) or ""),
        "",
        *_field_table(root, "", composed, skip_groups=True),
        "",
    ]
    for name, field in root.model_fields.items():
        group = _group_model(field)
        if group is None:
            continue
        lines += [
            f"## `{name}`",
            "",
            f"Schema: [`{group.__name__}`][{group.__module__}.{group.__name__}]. {_cell(inspect.getdoc(group) or '')}",
            "",
            *_field_table(group, f"{name}.", composed.get(name, {}), skip_groups=False),
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    nav = mkdocs_gen_files.Nav()
    write_api_pages(nav)
    with mkdocs_gen_files.open("reference/SUMMARY.md", "w") as fd:
        fd.writelines(nav.build_literate_nav())
    with mkdocs_gen_files.open(CONFIG_PAGE, "w") as fd:
        fd.write(config_reference())
    mkdocs_gen_files.set_edit_path(CONFIG_PAGE, Path("framework/config/schema.py"))


main()
