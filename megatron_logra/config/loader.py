"""YAML files and ``section.key=value`` overrides -> a validated :class:`Config`.

Keys are dotted paths through the nested sections (``rl.loss.grpo.clip_low=0.3``). Values are
parsed as YAML and checked (and, where lossless, converted) against the field's annotation, so a
typo or a wrong type fails with a message naming the full key. Imports no torch: the recipes and
a submission host use the same parser.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from megatron_logra.config.root import COMMAND_DEFAULTS, Config

# Fields of Config that are bookkeeping, not settings a user can write.
_INTERNAL_FIELDS = frozenset({"provided"})
# Keys of the flat layout before the sections were nested (2026-12), so an old config or
# command line fails with the new name instead of a bare "unknown key".
_MOVED: dict[str, str] = {
    **{f"kl_control.{k}": f"logra.kl_control.{k}" for k in (
        "kl_budget", "kl_budget_final", "schedule_steps", "alpha_max", "mismatch_subtraction",
        "mismatch_ema_weight", "mismatch_budget_floor", "probe_responses", "probe_max_tokens",
        "temperature", "mismatch_input")},
    **{f"rl.{k}": f"rl.sampling.{k}" for k in ("max_new_tokens", "temperature", "top_p")},
    **{f"rl.{k}": f"rl.advantages.paper.{k}" for k in (
        "failure_reward", "running_baseline_weight", "response_length_reference")},
    "rl.importance_weight_cap": "rl.loss.correction.tis_cap",
    "rl.loss.paper.importance_weight_cap": "rl.loss.correction.tis_cap",
    **{f"rl.{k}": f"rl.loss.grpo.{k}" for k in ("clip_low", "clip_high", "kl_beta")},
    **{f"rl.eval_{k}": f"rl.eval.{k}" for k in (
        "interval", "prompts", "samples", "temperature", "top_p")},
    "lora.rank": "lora.lora_rank",
}
# Keys that were values and are sections now: the value moved to one key inside.
_NOW_SECTIONS: dict[str, str] = {
    "logra.kl_control": "logra.kl_control.enabled",
    "rl.loss": "rl.loss.name",
    "rl.reward": "rl.reward.name",
}


def _fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)
            if f.name not in _INTERNAL_FIELDS}


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and dataclasses.is_dataclass(annotation)


def _unknown(parts: tuple[str, ...], depth: int, valid: dict[str, Any]) -> ValueError:
    dotted = ".".join(parts)
    moved = f"; it is {_MOVED[dotted]} now" if dotted in _MOVED else ""
    if depth == 0:
        return ValueError(
            f"unknown config section {parts[0]!r} (in {dotted}); valid sections are "
            f"{sorted(valid)}{moved}"
        )
    prefix = ".".join(parts[:depth])
    return ValueError(
        f"unknown config key {'.'.join(parts[:depth + 1])}; valid keys in {prefix!r} are "
        f"{sorted(valid)}{moved}"
    )


def _not_a_mapping(dotted: str, value: Any) -> ValueError:
    hint = f" (set {_NOW_SECTIONS[dotted]} instead)" if dotted in _NOW_SECTIONS else ""
    return ValueError(f"config section {dotted!r} must be a mapping, got {value!r}{hint}")


def _is_mapping(annotation: Any) -> bool:
    return typing.get_origin(annotation) is dict


def check_key(parts: tuple[str, ...]) -> Any:
    """The annotation of the field at dotted path ``parts``; ValueError naming it if unknown.
    A mapping-valued field takes one more part, its entry (``data.prompt.template_kwargs.x``)."""
    cls: Any = Config
    for depth, part in enumerate(parts):
        if _is_mapping(cls) and depth == len(parts) - 1:
            return typing.get_args(cls)[1]
        if not _is_section(cls):
            raise ValueError(
                f"config key {'.'.join(parts[:depth])} is a value, not a section (in "
                f"{'.'.join(parts)})"
            )
        fields = _fields(cls)
        if part not in fields:
            raise _unknown(parts, depth, fields)
        cls = fields[part]
    return cls


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    """``a.b.c=value`` -> (("a", "b", "c"), YAML-parsed value), the key checked to exist."""
    if "=" not in text:
        raise ValueError(f"override {text!r} must look like section.key=value")
    dotted, raw = text.split("=", 1)
    parts = tuple(dotted.strip().split("."))
    if len(parts) < 2 or not all(parts):
        raise ValueError(f"override {text!r} must look like section.key=value")
    check_key(parts)
    if not raw.strip():
        return parts, ""
    try:
        return parts, yaml.safe_load(raw)
    except yaml.YAMLError as error:
        raise ValueError(
            f"override {text!r}: its value is not valid YAML ({_yaml_problem(error)}); quote a "
            "string, close a bracket, or write a list as [a, b]"
        ) from None


def _yaml_problem(error: yaml.YAMLError) -> str:
    """What the YAML parser complains about, and where (1-based line and column)."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    if mark is None:
        return problem
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"


def _coerce(path: str, value: Any, annotation: Any) -> Any:
    """Check (and where lossless, convert) a YAML value against a field annotation."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        non_none = [opt for opt in options if opt is not type(None)]
        return _coerce(path, value, non_none[0])
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        if isinstance(value, str):
            value = [item.strip() for item in value.split(",") if item.strip()]
        if not isinstance(value, list):
            items = {int: "integers", float: "numbers", str: "strings"}.get(item_type, "values")
            raise ValueError(f"{path}={value!r} must be a list of {items}")
        return [_coerce(f"{path}[{i}]", item, item_type) for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{path}={value!r} must be a mapping, e.g. {{name: value}}")
        out = {}
        for key, item in value.items():
            if not isinstance(key, str) or not isinstance(item, (bool, int, float, str)):
                raise ValueError(f"{path}.{key}={item!r}: a mapping's keys must be names and "
                                 "its values true/false, numbers or strings")
            out[key] = item
        return out
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{path}={value!r} must be true or false")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ValueError(f"{path}={value!r} must be an integer")
    if annotation is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            # YAML 1.1 reads "1e-3" (no decimal point) as a string; it is the usual way to
            # write a learning rate, so accept any string Python parses as a float.
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ValueError(f"{path}={value!r} must be a number")
        # No setting means anything at NaN or infinity (YAML writes them .nan, .inf).
        if not math.isfinite(number):
            raise ValueError(f"{path}={value!r} must be a finite number")
        return number
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"{path}={value!r} must be a string")
    raise TypeError(f"unsupported config annotation {annotation!r} for {path}")


def _build(cls: type, values: Any, parts: tuple[str, ...], provided: set[str]) -> Any:
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise _not_a_mapping(".".join(parts), values)
    fields = _fields(cls)
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        key_parts = (*parts, str(key))
        if key not in fields:
            first = next(iter(value), None) if isinstance(value, dict) and not parts else None
            raise _unknown((*key_parts, first) if first else key_parts, len(parts), fields)
        annotation = fields[key]
        if _is_section(annotation):
            kwargs[key] = _build(annotation, value, key_parts, provided)
        else:
            dotted = ".".join(key_parts)
            kwargs[key] = _coerce(dotted, value, annotation)
            provided.add(dotted)
    return cls(**kwargs)


def config_from_dict(data: dict[str, Any] | None) -> Config:
    """A validated Config from nested ``{section: {key: value}}`` data."""
    provided: set[str] = set()
    cfg = _build(Config, data, (), provided)
    cfg = dataclasses.replace(cfg, provided=frozenset(provided))
    cfg.validate()
    return cfg


def _set(data: dict[str, Any], parts: tuple[str, ...], value: Any) -> None:
    node = data
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise _not_a_mapping(".".join(parts[:depth + 1]), child)
        node = child
    node[parts[-1]] = value


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ValueError(
            f"config file {str(path)!r} is not valid YAML: {_yaml_problem(error)}"
        ) from None
    except UnicodeDecodeError as error:
        raise ValueError(f"config file {str(path)!r} is not UTF-8 text ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping of sections")
    return data


def _merge(base: dict[str, Any], layer: dict[str, Any]) -> dict[str, Any]:
    """``layer`` over ``base``, key by key through nested sections (a later file wins)."""
    merged = dict(base)
    for key, value in layer.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(
    path: str | Path | list[str | Path] | tuple[str | Path, ...] | None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    command: str = "train",
) -> Config:
    """Read a YAML file, or several laid over each other key by key (a preset, then the
    ``model.yaml`` of ``tools/convert_hf.py``: later files win), or start from defaults; apply
    ``command``'s defaults and then the overrides (later ones win), validate."""
    paths = [] if path is None else [path] if isinstance(path, (str, Path)) else list(path)
    data: dict[str, Any] = {}
    for item in paths:
        data = _merge(data, _read_file(Path(item)))
    if command not in COMMAND_DEFAULTS:
        raise ValueError(f"command {command!r} is not one of {sorted(COMMAND_DEFAULTS)}")
    for text in (*COMMAND_DEFAULTS[command], *overrides):
        parts, value = parse_override(text)
        _set(data, parts, value)
    return config_from_dict(data)
