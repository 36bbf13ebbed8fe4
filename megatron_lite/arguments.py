"""Command-line flags (Megatron-LM names) -> a `Config`, then `validation.validate()`.

The parser is generated from the `config` package: every field declared with `option(default, flag, ...)`
becomes that flag, its docstring the help, its dataclass default the only default (argparse
keeps none: a flag not given leaves the field as the dataclass declares it). The reverse,
`config_to_argv`, writes a `Config` back as flags (the tuning planner's command lines).
Every rule lives in `megatron_lite.validation`, which runs before any process group exists, so
a bad combination costs the user one clear line instead of a traceback from inside
torch.distributed or DeepSpeed.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import importlib
import inspect
import os
import pkgutil
import sys
import typing
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron_lite import config as config_module
from megatron_lite.config import Config, ConfigError, flag_fields, parse_data_path, parse_split  # noqa: F401
from megatron_lite.flag_numbers import number
from megatron_lite.refusal import refuse
from megatron_lite.training.distributed import is_rank_zero_from_environment
from megatron_lite.validation import validate
from megatron_lite.validation.numbers import bounds_of, example_of
from megatron_lite.validation.resume import with_checkpoint_args

LAUNCHER_FLAGS = (
    (("--local-rank", "--local_rank"),
     dict(type=int, default=argparse.SUPPRESS,
          help="passed by the deepspeed launcher; LOCAL_RANK from the environment is what is used")),
)
"""Flags launchers add that set nothing in the config."""


@functools.lru_cache(maxsize=None)
def field_docs() -> Dict[Tuple[str, str], str]:
    """(dataclass name, field name) -> the field's docstring, one line; a field a section inherits (ModelConfig's,
    declared in config/model_*.py) under the section's name too."""
    docs = {}
    for module in _config_modules():
        tree = ast.parse(inspect.getsource(module))
        for node in tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            for statement, following in zip(node.body, node.body[1:]):
                if (isinstance(statement, ast.AnnAssign) and isinstance(following, ast.Expr)
                        and isinstance(following.value, ast.Constant) and isinstance(following.value.value, str)):
                    docs[(node.name, statement.target.id)] = " ".join(following.value.value.split())
    for section in [Config] + [f.default_factory for f in dataclasses.fields(Config)]:
        for f in dataclasses.fields(section):
            owner = next((c for c in section.__mro__ if (c.__name__, f.name) in docs), None)
            if owner is not None:
                docs.setdefault((section.__name__, f.name), docs[(owner.__name__, f.name)])
    return docs


def _config_modules() -> List[Any]:
    """The modules of the megatron_lite.config package, whose classes declare the fields and their docstrings."""
    return [config_module] + [importlib.import_module(f"{config_module.__name__}.{m.name}")
                              for m in pkgutil.iter_modules(config_module.__path__)]


def _section_class(section: str):
    return next(f.default_factory for f in dataclasses.fields(Config) if f.name == section)


@functools.lru_cache(maxsize=None)
def _section_hints(section: str) -> Dict[str, Any]:
    # Once per section: evaluating a class's string annotations for each of its flags, twice, on every
    # parse was most of a parse (a planner or a --longest-sequence search parses hundreds of times).
    return typing.get_type_hints(_section_class(section))


def _value_type(section: str, field: dataclasses.Field):
    """int / float / str from the annotation (Optional[...] unwrapped)."""
    hint = _section_hints(section)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint


def _action(section: str, field: dataclasses.Field) -> str:
    action = field.metadata.get("action")
    if action is None and _value_type(section, field) is bool:
        return "store_true"
    return action or "store"


def _show_default(field: dataclasses.Field) -> Optional[str]:
    """The default as a user would type it, for the help; None when there is nothing to show."""
    default, meta = field.default, field.metadata
    if default is None or isinstance(default, bool) or default == ():
        return None
    if "unparse" in meta:
        return " ".join(meta["unparse"](default))
    if isinstance(default, tuple):
        return " ".join(map(str, default))
    return repr(default) if isinstance(default, float) else str(default)


def dest(section: str, field: dataclasses.Field) -> str:
    return f"{section}.{field.name}"


def _add_flag(group, section: str, field: dataclasses.Field) -> None:
    meta = field.metadata
    help_text = field_docs()[(_section_class(section).__name__, field.name)]
    shown = _show_default(field)
    if shown is not None:
        help_text += f" (default: {shown})"
    kwargs: Dict[str, Any] = dict(dest=dest(section, field), default=argparse.SUPPRESS,
                                  help=help_text.replace("%", "%%"))
    action = _action(section, field)
    if action == "boolean_optional":
        kwargs["action"] = argparse.BooleanOptionalAction
    elif action in ("store_true", "store_false"):
        kwargs["action"] = action
    else:
        value_type = _value_type(section, field)
        if "parse" not in meta and "nargs" in meta and typing.get_origin(value_type) is tuple:
            value_type = typing.get_args(value_type)[0]
        if "parse" not in meta and value_type in (int, float):
            # argparse refuses nan, 1e30 or -1 where the field's range does not hold it, naming the flag
            bounds = bounds_of(field)
            kwargs["type"] = number(value_type, example_of(field, bounds), **bounds)
        for key in ("choices", "nargs", "metavar"):
            if key in meta:
                kwargs[key] = meta[key]
        if "choices" not in meta:
            kwargs.setdefault("metavar", field.name.upper())
    group.add_argument(meta["flag"], *meta.get("aliases", ()), **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        usage="%(prog)s [flags: --help lists them, with Megatron-LM's names]",  # not the 3-screen list of all
        description="Pretrain a GPT with tensor, pipeline and data parallelism (Megatron-LM flag names).",
        allow_abbrev=False,
    )
    groups = {}
    for section, field in flag_fields():
        if section not in groups:
            groups[section] = parser.add_argument_group(section, field_docs().get(("Config", section)))
        _add_flag(groups[section], section, field)
    launcher = parser.add_argument_group("launcher")
    for names, kwargs in LAUNCHER_FLAGS:
        launcher.add_argument(*names, **kwargs)
    return parser


def world_size_from_environment() -> int:
    """World size as the launcher sets it: torchrun / deepspeed (WORLD_SIZE) or plain srun (SLURM_NTASKS)."""
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        if os.environ.get(name):
            return int(os.environ[name])
    return 1


def given_fields(args: argparse.Namespace) -> Dict[str, Any]:
    """`section__field` -> value for every config flag given on the command line (others absent)."""
    values = vars(args)
    given = {}
    for section, field in flag_fields():
        key = dest(section, field)
        if key not in values:
            continue
        value = values[key]
        if "parse" in field.metadata:
            value = field.metadata["parse"](value)
        elif isinstance(value, list):
            value = tuple(value)
        given[f"{section}__{field.name}"] = value
    return given


def config_from_args(args: argparse.Namespace, world_size: int) -> Config:
    """Flags -> dataclasses, one to one; nothing is checked or derived here."""
    return Config().replace(parallel__world_size=world_size, **given_fields(args))


def config_from_argv(argv: Sequence[str], world_size: int = 1) -> Config:
    """pretrain_gpt.py's flags -> an unvalidated Config (argparse exits 2 on an unknown flag)."""
    return config_from_args(build_parser().parse_args(list(argv)), world_size)


def config_to_argv(config: Config, sections: Optional[Sequence[str]] = None, fields: Optional[Sequence[str]] = None,
                   exclude: Sequence[str] = (), include_defaults: bool = False) -> List[str]:
    """The flags that give `config` from the defaults: one per field whose value differs from its
    dataclass default (`include_defaults`: every field with a value), in `sections` / `fields` only
    when given, never those named in `exclude`. Inverse of config_from_argv."""
    argv: List[str] = []
    for section, field in flag_fields():
        if ((sections is not None and section not in sections) or (fields is not None and field.name not in fields)
                or field.name in exclude):
            continue
        value = getattr(getattr(config, section), field.name)
        if value == field.default and not (include_defaults and value not in (None, False, ())):
            continue
        meta, action = field.metadata, _action(section, field)
        if action == "store_true" or action == "store_false":
            if value != field.default:  # a two-valued field differs from its default only one way
                argv.append(meta["flag"])
        elif action == "boolean_optional":
            argv.append(meta["flag"] if value else "--no-" + meta["flag"][2:])
        elif value is None:
            raise ConfigError(f"{meta['flag']} has no command-line form for None (its default is {field.default})")
        elif "unparse" in meta:
            argv += [meta["flag"], *meta["unparse"](value)]
        elif isinstance(value, tuple):
            argv += [meta["flag"], *map(str, value)]
        else:
            argv += [meta["flag"], repr(value) if isinstance(value, float) else str(value)]
    return argv


def parse_args(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None) -> Tuple[Config, List[str]]:
    """Parse and validate; raises ConfigError. argparse itself exits 2 on unknown flags."""
    args = build_parser().parse_args(argv)
    world = world_size if world_size is not None else world_size_from_environment()
    config = config_from_args(args, world)
    if config.training.use_checkpoint_args:
        config = with_checkpoint_args(config, given_fields(args))
    return validate(config)


def parse_args_or_exit(argv: Optional[Sequence[str]] = None) -> Config:
    """Entry-point form: print the error (rank 0 only) and exit 2, without a traceback."""
    try:
        config, notes = parse_args(argv)
    except ConfigError as e:
        refuse(f"pretrain_gpt.py: error: {e}")  # every rank refuses; seen once under any launcher (refusal.py)
    if is_rank_zero_from_environment():
        for note in notes:
            print(note, file=sys.stderr, flush=True)
    return config
