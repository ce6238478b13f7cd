"""The server's chat template override (`--chat-template`, vLLM's flag): a Jinja file, or the
template itself. Read once by cli.py (fails before anything starts) and by the server process,
which renders every chat request with it instead of the checkpoint's."""

from __future__ import annotations

from pathlib import Path

# what makes a value the template itself rather than a file name (vLLM tells them apart the same
# way: a path that is not a file and holds Jinja markup is the template)
_JINJA_MARKS = ("{{", "{%")


class ChatTemplateError(ValueError):
    """The --chat-template value is no readable file and no Jinja template, or does not parse."""


def load_chat_template(value: str) -> tuple[str, str] | None:
    """(template text, where it came from) of a --chat-template value, or None for "" (the
    checkpoint's own). Raises ChatTemplateError naming the problem."""
    if not value:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        try:
            text, source = path.read_text(encoding="utf-8"), str(path)
        except (OSError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"--chat-template {value}: cannot read it ({exc})") from None
    elif any(mark in value for mark in _JINJA_MARKS):
        text, source = value, "the --chat-template text"
    else:
        raise ChatTemplateError(
            f"--chat-template {value}: no such file, and not a Jinja template either (give a "
            "template file, or the template text itself)"
        )
    _check_syntax(text, source)
    return text, source


def _check_syntax(text: str, source: str) -> None:
    """A template that does not parse fails at startup, not on the first chat request. Parsed in
    the environment transformers renders chat templates in (sandboxed, loop controls)."""
    from jinja2 import TemplateSyntaxError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(extensions=[loopcontrols]).parse(text)
    except TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"--chat-template: {source} is not a valid Jinja template (line {exc.lineno}: "
            f"{exc.message})"
        ) from None
