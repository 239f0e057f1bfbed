"""The job's command-line flags, derived from the API's job schema (`JobSpec`'s JSON schema,
as openapi/openapi.json publishes it): one flag per field, named after the field (`--lora-alpha`
for `lora.lora_alpha`), its type, choices, default and help taken from the schema.

Only what the schema cannot say is written here: the sections that get flags and the argument
group each lands in, the flags whose names differ from their field's, the short aliases, and
the fields the command line takes another way (the model, the GPU, the stack, the allocator).
A field that several sections share under one name (`--max-completion-length` for DPO and
GRPO) is one flag; the command's spec builder sends its value where the job's method and
objective need it.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

# The sections whose fields get flags, by argument group (None: the parser's own, for the
# main fields); "" is the job's top level. Sections left out are taken another way (parallel
# configs from a file, the allocator from --alloc-conf) or are other methods' (PEFT's VeRA,
# LoHa, ... take the LoRA flags their fields share).
GROUPS: tuple[tuple[str | None, tuple[str, ...]], ...] = (
    (None, ("",)),
    ("LoRA (PEFT LoraConfig)", ("lora",)),
    (
        "prompt and prefix tuning (PEFT PromptTuningConfig, PrefixTuningConfig)",
        ("prefix_tuning", "prompt_tuning"),
    ),
    ("images (a vision-language model: Qwen2-VL, Qwen2.5-VL, Llama-3.2-Vision)", ("vision",)),
    ("QLoRA (bitsandbytes, GPTQ, AWQ, HQQ, torchao)", ("quantization",)),
    ("training", ("", "dpo", "kto", "grpo", "orpo")),
    ("parallelism", ("parallel",)),
)
# The top-level fields that sit on the parser itself, before the groups.
MAIN_FIELDS = ("method", "batch_size", "seq_len")
# Flags whose names are not their field's.
RENAMED = {
    "quantization.type": "--quant",
    "kto.loss_type": "--kto-loss-type",
    "grpo.beta": "--grpo-beta",
    "orpo.disable_dropout": "--keep-dropout",
}
SHORT = {"batch_size": "-b", "seq_len": "-s"}
# Fields the command line takes another way: the model (a positional or --config), the GPU
# (each command's own --gpu), the stack (--stack's preset or versions), the node size (`fit`'s
# placement option of that name).
TAKEN_ELSEWHERE = frozenset({"model", "gpu", "stack", "parallel.gpus_per_node"})
# The error text for a whole section, where the joined flags would not say it.
SECTION_OPTIONS = {
    "lora": "--r/--target-modules",
    "quantization": "--quant",
    "orpo": "--objective orpo/--keep-dropout",
    "vision": "--images-per-sample/--image-height/--image-width/--image-tokens",
}


@dataclass(frozen=True)
class JobFlag:
    """One flag: the spec fields it sets (the first is where its value goes), and how."""

    option: str
    dest: str
    paths: tuple[str, ...]
    group: str | None
    kind: str  # "bool", "int", "float", "str", "choice" or "list" (comma-separated)
    consts: tuple[str, ...]  # a list field's single-word values ("all-linear")
    arguments: tuple[tuple[str, Any], ...]  # argparse's keywords

    def value(self, args: argparse.Namespace) -> Any:
        """The flag's value as the spec takes it; None when not given."""
        raw = getattr(args, self.dest, None)
        if raw is None or self.kind != "list":
            return raw
        text = str(raw).strip()
        if text in self.consts:
            return text
        names = [n.strip() for n in text.split(",") if n.strip()]
        return names or None


def _job_schema() -> dict[str, Any]:
    from service.api.schemas.jobs import JobSpec

    return JobSpec.model_json_schema()


def _resolve(node: Mapping[str, Any], defs: Mapping[str, Any]) -> Mapping[str, Any]:
    ref = node.get("$ref")
    return defs[ref.rsplit("/", 1)[-1]] if isinstance(ref, str) else node


def _alternatives(node: Mapping[str, Any], defs: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The non-null schemas a field takes, references resolved."""
    options = node.get("anyOf", [node])
    return [_resolve(o, defs) for o in options if o.get("type") != "null"]


def _kind(node: Mapping[str, Any], defs: Mapping[str, Any]) -> tuple[str, tuple[str, ...]]:
    """A field's flag kind and its choices (an enum's values, a list's constants); ("", ())
    for a field no flag can give (an object)."""
    alternatives = _alternatives(node, defs)
    consts = tuple(str(a["const"]) for a in alternatives if "const" in a)
    kinds = {a.get("type") for a in alternatives if "const" not in a}
    if "array" in kinds:
        return "list", consts
    if len(alternatives) == 1 and "enum" in alternatives[0]:
        return "choice", tuple(str(v) for v in alternatives[0]["enum"])
    simple = {"boolean": "bool", "integer": "int", "number": "float", "string": "str"}
    if len(kinds) == 1 and not consts and (kind := simple.get(str(next(iter(kinds))))):
        return kind, ()
    return "", ()


def _help(node: Mapping[str, Any], kind: str, default: Any) -> str:
    text = str(node.get("description", "")).replace("%", "%%")
    if kind == "list":
        text += " (comma-separated)"
    if default is not None and kind != "bool" and default != []:
        text += f" (default {default})"
    return text


def _flag(
    path: str, node: Mapping[str, Any], group: str | None, top: bool, defs: Mapping[str, Any]
) -> JobFlag | None:
    kind, choices = _kind(node, defs)
    if not kind:
        return None
    name = path.rsplit(".", 1)[-1].replace("_", "-")
    default = node.get("default")
    negated = kind == "bool" and default is True
    option = RENAMED.get(path) or ("--no-" if negated else "--") + name
    dest = name.replace("-", "_") if negated else option[2:].replace("-", "_")
    arguments: dict[str, Any] = {"dest": dest, "help": _help(node, kind, default)}
    if kind == "bool":
        arguments |= {"action": "store_false" if negated else "store_true", "default": None}
    else:
        arguments["type"] = {"int": int, "float": float}.get(kind, str)
        arguments["default"] = default if top and kind != "list" else None
        if kind == "choice":
            arguments["choices"] = list(choices)
        if top and "default" not in node:
            arguments["required"] = True
    return JobFlag(option, dest, (path,), group, kind, choices, tuple(arguments.items()))


def _section_fields(schema: Mapping[str, Any], section: str) -> Mapping[str, Any]:
    defs = schema.get("$defs", {})
    if not section:
        return dict(schema["properties"])
    node = schema["properties"][section]
    objects = [a for a in _alternatives(node, defs) if "properties" in a]
    return dict(objects[0]["properties"]) if objects else {}


def _offered(path: str, section: str, group: str | None) -> bool:
    """Whether a field gets a flag in `group`: not when the command line takes it another
    way; a top-level field on the parser itself only if it is a main one, in its group if not."""
    if path in TAKEN_ELSEWHERE:
        return False
    return bool(section) or (group is None) == (path in MAIN_FIELDS)


@cache
def job_flags() -> tuple[JobFlag, ...]:
    """Every job flag, in the order the groups lay them out; one flag per option name, with
    every field of that name among its paths."""
    schema = _job_schema()
    defs = schema.get("$defs", {})
    flags: dict[str, JobFlag] = {}
    for group, sections in GROUPS:
        for section in sections:
            for field, node in _section_fields(schema, section).items():
                path = f"{section}.{field}" if section else field
                flag = _flag(path, node, group, not section, defs)
                if flag is None or not _offered(path, section, group):
                    continue
                known = flags.get(flag.option)
                if known is None:
                    flags[flag.option] = flag
                else:
                    flags[flag.option] = replace(known, paths=(*known.paths, path))
    return tuple(flags.values())


def add_job_flags(
    parser: argparse.ArgumentParser, *, require_job: bool = True
) -> dict[str | None, Any]:
    """Add every job flag to `parser`, in its groups; returns the groups by title (None: the
    parser) for the hand-laid options beside them. With `require_job` False, no flag is
    required."""
    groups: dict[str | None, Any] = {None: parser}
    for title, _sections in GROUPS:
        if title is not None:
            groups[title] = parser.add_argument_group(title)
    for flag in job_flags():
        arguments = dict(flag.arguments)
        if not require_job:
            arguments.pop("required", None)
        names = [SHORT[flag.paths[0]], flag.option] if flag.paths[0] in SHORT else [flag.option]
        groups[flag.group].add_argument(*names, **arguments)
    return groups


def given_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The job fields the flags give, nested as the job's JSON (each flag's value at its first
    path); flags not given are left out, so the spec's defaults fill them."""
    data: dict[str, Any] = {}
    for flag in job_flags():
        value = flag.value(args)
        if value is None:
            continue
        *sections, field = flag.paths[0].split(".")
        target = data
        for section in sections:
            target = target.setdefault(section, {})
        target[field] = value
    return data


@cache
def field_options() -> dict[str, str]:
    """The option that sets each spec field (dotted, as errors name it), and each section's."""
    options: dict[str, str] = {}
    by_section: dict[str, list[str]] = {}
    for flag in job_flags():
        for path in flag.paths:
            options[path] = flag.option
            section, dot, _field = path.partition(".")
            if dot and flag.option not in by_section.setdefault(section, []):
                by_section[section].append(flag.option)
    sections = {section: "/".join(names) for section, names in by_section.items()}
    return {**sections, **SECTION_OPTIONS, **options}
