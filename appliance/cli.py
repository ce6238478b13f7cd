"""The `appliance` command: `appliance serve [MODEL] [--revision REV] --tp N --port P ...`.

Entry point of the console script (pyproject) and `python -m appliance.cli`. Every flag but
--revision is generated from a field of the frozen config dataclasses (appliance/config.py): the
default is the field's default and the help text is the field's comment, so the dataclass stays
the one source of truth. MODEL and --revision are resolved here (assets/resolve.py) before the
launcher starts; the config carries the resolved folder. Errors are one line, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import re
import sys
import typing
from pathlib import Path
from typing import Any, NoReturn

from appliance import __version__, envs
from appliance.config import ServeConfig
from appliance.flag_aliases import FLAG_ALIASES, FLAG_HINTS
from appliance.flag_translation import add_foreign_flags, translate_args

_POSITIONAL = {"model_dir"}  # ModelConfig.model_dir is the positional MODEL


def _field_comments(cls: type) -> dict[str, str]:
    """`name: type = default  # comment` lines of a dataclass's source -> {name: comment}; a field
    without one takes the `# ...` lines just above it (a comment too long for one line)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    found: dict[str, str] = {}
    above: list[str] = []
    for line in source.splitlines():
        if comment := re.match(r"^\s+#\s*(.+)$", line):
            above.append(comment.group(1))
            continue
        if field := re.match(r"^\s+(\w+):[^#\n]*?(?:#\s*(.+))?$", line):
            text = field.group(2) or " ".join(above)
            if text:
                found[field.group(1)] = text
        above = []
    return found


def _nested(cls: type) -> dict[str, type]:
    """Fields of a config dataclass whose type is itself a dataclass: {name: class}."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(cls)
        if dataclasses.is_dataclass(hints.get(f.name))
    }


def _config_sections(root: type = ServeConfig, path: tuple[str, ...] = ()):
    """Yields (path, class) for every config dataclass under root that holds plain fields."""
    nested = _nested(root)
    if len(nested) < len(dataclasses.fields(root)):
        yield path, root
    for name, cls in nested.items():
        yield from _config_sections(cls, (*path, name))


def _add_flags(parser: argparse.ArgumentParser) -> dict[str, tuple[tuple[str, ...], str]]:
    """Adds one flag per config field; returns dest -> (section path, field name)."""
    dests: dict[str, tuple[tuple[str, ...], str]] = {}
    for path, cls in _config_sections():
        group = parser.add_argument_group(f"{cls.__name__} ({'.'.join(path)})")
        comments = _field_comments(cls)
        for f in dataclasses.fields(cls):
            if f.name in _POSITIONAL or f.name in _nested(cls):
                continue
            if f.name in dests:
                raise RuntimeError(f"config field {f.name} defined twice; flags must be unique")
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            flags = ("--" + f.name.replace("_", "-"), *FLAG_ALIASES.get(f.name, ()))
            help_text = f"{comments.get(f.name, '')} (default: {default!r})"
            if isinstance(default, bool):
                group.add_argument(
                    *flags,
                    dest=f.name,
                    action=argparse.BooleanOptionalAction,
                    default=None,
                    help=help_text,
                )
            else:
                group.add_argument(
                    *flags,
                    dest=f.name,
                    type=type(default),
                    default=None,
                    metavar=type(default).__name__.upper(),
                    help=help_text,
                )
            dests[f.name] = (path, f.name)
    return dests


def _build_config(args: argparse.Namespace, dests) -> ServeConfig:
    """Overrides the dataclass defaults with the flags given; validation errors name the field."""
    overrides: dict[tuple[str, ...], dict[str, Any]] = {}
    for dest, (path, name) in dests.items():
        value = getattr(args, dest)
        if value is not None:
            overrides.setdefault(path, {})[name] = value
    overrides.setdefault(("engine", "model"), {})["model_dir"] = args.model_dir or ""

    def build(cls: type, path: tuple[str, ...]):
        kwargs = dict(overrides.get(path, {}))
        for name, sub in _nested(cls).items():
            kwargs[name] = build(sub, (*path, name))
        return cls(**kwargs)

    return build(ServeConfig, ())


def _env_help() -> str:
    lines = ["environment variables:"]
    for var in envs.registry().values():
        choices = f" [{'|'.join(var.choices)}]" if var.choices else ""
        lines.append(f"  {var.name}={var.default!r}{choices}  {var.doc}")
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    """Argument errors are one line (`appliance serve: error: ...`), not the whole usage block;
    an unknown flag that vLLM or SGLang has names this appliance's nearest one."""

    def error(self, message: str) -> NoReturn:
        hints = [f"{flag}: use {ours}" for flag, ours in FLAG_HINTS.items() if flag in message]
        hint = f"; {'; '.join(hints)}" if hints else ""
        self.exit(2, f"{self.prog}: error: {message}{hint} (see {self.prog} --help)\n")


def _flag_error(message: str, args: argparse.Namespace, sources: dict[str, str]) -> str:
    """A config validation error (`field: expected ...`) with the flag and the value given
    (`sources`: a field a vLLM / SGLang flag set -> that flag, named with ours)."""
    name, sep, expected = message.partition(": ")
    if sep and name in sources:
        return f"{sources[name]}: {expected} (as --{name.replace('_', '-')})"
    if sep and hasattr(args, name) and getattr(args, name) is not None:
        return f"--{name.replace('_', '-')} {getattr(args, name)}: {expected}"
    return message


class _FullHelp(argparse.Action):
    """`appliance --help` prints every subcommand's flags, not just the subcommand names."""

    def __init__(self, option_strings, dest, subparsers=None, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)
        self.subparsers = subparsers

    def __call__(self, parser, namespace, values, option_string=None):
        parts = [parser.format_help()]
        for name, sub in self.subparsers.choices.items():
            parts.append(f"\n===== appliance {name} =====\n{sub.format_help()}")
        parts.append("\n" + _env_help() + "\n")
        sys.stdout.write("".join(parts))
        parser.exit()


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = _Parser(
        prog="appliance",
        add_help=False,
        description="OpenAI-compatible inference appliance for Qwen3.5 and Qwen3-VL.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.add_argument(
        "-h",
        "--help",
        action=_FullHelp,
        subparsers=subparsers,
        help="show every command's options and exit",
    )
    parser.add_argument("-V", "--version", action="version", version=f"appliance {__version__}")
    serve = subparsers.add_parser(
        "serve",
        allow_abbrev=False,  # --max-model 5 is not --max-model-len
        help="start the appliance (server, router, detokenizer, TP workers)",
        description="Start the appliance and serve the OpenAI API until SIGTERM / Ctrl-C.",
        epilog=_env_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument(
        "model_dir",
        nargs="?",
        default="",
        metavar="MODEL",
        help="checkpoint folder (HF layout), or a Hugging Face Hub id ORG/NAME (resolved through "
        "the Hub cache: HF_HOME / HF_HUB_CACHE, HF_TOKEN, HF_HUB_OFFLINE); a folder wins over a "
        "Hub id of the same name; omitted = the embedded default model",
    )
    serve.add_argument(
        "--revision",
        default="",
        metavar="REV",
        help="Hub branch, tag or commit of a Hub id MODEL (default: main)",
    )
    dests = _add_flags(serve)
    add_foreign_flags(serve)
    subparsers.add_parser(
        "backends",
        help="print the kernel backend each op resolves to on this machine",
        description="Resolve APPLIANCE_GDN_PREFILL_BACKEND, APPLIANCE_FP8_GEMM and the attention "
        "backend against what this machine has, and print the table.",
    )
    return parser, dests


def _print_backends() -> int:
    try:  # before importing torch: a bad flag fails at once
        requested = envs.kernel_backends()
    except envs.EnvError as exc:
        _fail(str(exc), code=1, command="backends")
    from appliance.logging import setup_logging
    from appliance_kernels.backends import detect_platform, resolve_backends

    setup_logging()
    platform = detect_platform()
    print(f"platform: {platform}")
    table = resolve_backends(**requested, platform=platform)
    for kind, name in table.items():
        print(f"{kind:<12} {name}")
    from appliance_kernels.fp8_block import block_route_summary

    # block-scaled fp8 weights (Qwen's -FP8 repos): what their GEMMs of 2+ rows run on
    print(f"{'fp8_block':<12} {block_route_summary(table['fp8_gemm'], platform.cuda)}")
    return 0


def _serve_config(args: argparse.Namespace, dests) -> tuple[ServeConfig, list[str]]:
    """The config the flags ask for, vLLM's and SGLang's translated (flag_translation.py), and
    the INFO lines for theirs that change nothing here; a refused value exits with one line."""
    try:
        foreign = translate_args(args)
    except ValueError as exc:
        _fail(str(exc))
    try:
        return _build_config(args, dests), foreign.notes
    except ValueError as exc:
        _fail(_flag_error(str(exc), args, foreign.sources))


def _fail(message: str, code: int = 2, command: str = "serve") -> NoReturn:
    """One error line on stderr, no usage block, no traceback; exits with `code`."""
    sys.stderr.write(f"appliance {command}: error: {message}\n")
    raise SystemExit(code)


def _resolve_model(config: ServeConfig, revision: str) -> ServeConfig:
    """The config with the checkpoint folder MODEL names (a folder, a Hub id's snapshot in the Hub
    cache, or the embedded default model). A Hub model is served under its id unless
    --served-model-name says otherwise."""
    from appliance.assets.resolve import ModelNotFoundError, resolve_model_dir

    model = config.engine.model
    try:
        model_dir = resolve_model_dir(model.model_dir, revision, model.load_format)
    except ModelNotFoundError as exc:
        _fail(str(exc))
    server = config.server
    from_hub = model.model_dir and not Path(model.model_dir).expanduser().exists()
    if from_hub and not server.served_model_name:
        server = dataclasses.replace(server, served_model_name=model.model_dir)
    engine = dataclasses.replace(
        config.engine, model=dataclasses.replace(model, model_dir=str(model_dir))
    )
    return dataclasses.replace(config, engine=engine, server=server)


def _check_model_config(config: ServeConfig) -> None:
    """A config.json the workers cannot build a model from (not JSON, a missing field, an
    architecture not served, a quantization_config whose method, scheme or block size cannot load)
    or a --max-model-len past the model's positions fails here in one line naming it, before any
    process starts (vLLM refuses a longer context too)."""
    from appliance.models.config import load_text_config
    from appliance.models.layers.quant import UnsupportedQuantization
    from appliance.models.loader import unscaled_fp8_problem
    from appliance.models.registry import model_class, quant_layout_problem

    model = config.engine.model
    path = Path(model.model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        _fail(f"{path}: not a readable JSON config ({exc})")
    if not isinstance(raw, dict):
        _fail(f"{path}: expected a JSON object, got {type(raw).__name__}")
    try:
        text = load_text_config(path.parent, model.quantization)
        model_class(text)
    except UnsupportedQuantization as exc:
        _fail(f"{path.parent.name}: {exc}")
    except KeyError as exc:
        _fail(f"{path}: no {exc.args[0]!r}, which the model needs")
    except (TypeError, ValueError) as exc:
        _fail(f"{path}: {exc}")
    try:
        problem = text.tp_problem(config.engine.parallel.tp)
    except TypeError as exc:  # a size that is not a number (null)
        _fail(f"{path}: {exc}")
    if problem is not None:
        _fail(f"--tp {config.engine.parallel.tp}: {problem} ({path})")
    problem = quant_layout_problem(text, config.engine.parallel.tp)
    if problem is not None:
        _fail(f"{path.parent.name}: {problem}")
    problem = text.context_problem(model.max_model_len)
    if problem is not None:
        _fail(f"--max-model-len {problem} ({path})")
    if text.quant is not None and model.load_format != "dummy":
        problem = unscaled_fp8_problem(path.parent)
        if problem is not None:
            _fail(f"{path.parent}: {problem}")


def _check_generation_config(config: ServeConfig) -> None:
    """--generation-config naming a folder without the file, or a file with values no request
    may take, fails here in one line, before any process starts."""
    from appliance.generation_defaults import GenerationConfigError, generation_defaults

    try:
        generation_defaults(config.engine.model.model_dir, config.server.generation_config)
    except GenerationConfigError as exc:
        _fail(str(exc))


def _check_chat_template(config: ServeConfig) -> None:
    """--chat-template that is no file and no template, or does not parse, fails here in one
    line, before any process starts."""
    from appliance.chat_template import ChatTemplateError, load_chat_template

    try:
        load_chat_template(config.server.chat_template)
    except ChatTemplateError as exc:
        _fail(str(exc))


def _check_runner(runner: str) -> None:
    """--runner's module must be importable (found, not imported: the workers import it)."""
    import importlib.util

    module = runner.partition(":")[0]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is not there, an empty name
        found = False
    if not found:
        _fail(f"--runner {runner}: no module {module!r} can be imported")


def main(argv: list[str] | None = None) -> int:
    parser, dests = build_parser()
    args = parser.parse_args(argv)
    if args.command == "backends":
        try:
            return _print_backends()
        except BrokenPipeError:  # `appliance backends | head`: the reader left, as cat ends
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
    if args.command != "serve":  # bare `appliance`: what it can do
        parser.print_help(sys.stderr)
        return 2
    config, notes = _serve_config(args, dests)
    from appliance.launch import LaunchError, preflight, serve
    from appliance.logging import get_logger, setup_logging

    try:  # env flags and the port, before anything loads or starts
        preflight(config)
    except LaunchError as exc:
        _fail(str(exc), code=1)
    setup_logging()
    for note in notes:  # vLLM / SGLang flags that change nothing here
        get_logger(__name__).info(note)
    config = _resolve_model(config, args.revision)
    _check_model_config(config)
    _check_generation_config(config)
    _check_chat_template(config)
    _check_runner(config.launch.runner)
    try:
        return serve(config)
    except LaunchError as exc:  # the port was taken while the model was being resolved
        _fail(str(exc), code=1)


if __name__ == "__main__":
    sys.exit(main())
