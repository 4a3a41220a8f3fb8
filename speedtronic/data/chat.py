"""Supervised fine-tuning examples: a JSONL row rendered to text, and the spans of it that
carry the loss.

Two row formats (``speedtronic prepare --format``):

* ``chat``: ``{"messages": [{"role": ..., "content": ...}, ...]}`` rendered by a Jinja chat
  template -- the tokenizer's own (``chat_template`` of the ``tokenizer_config.json`` beside
  its ``tokenizer.json``) or a file given with ``--chat-template`` -- in a sandboxed Jinja
  environment configured as ``transformers`` configures its own (``trim_blocks``,
  ``lstrip_blocks``, ``loopcontrols``, ``raise_exception``). The loss-bearing spans are the
  assistant messages: for assistant message ``i`` the span runs from the end of the
  conversation up to ``i`` rendered with the generation prompt to the end of the
  conversation up to and including ``i`` (so the template's own end-of-turn text is part of
  the answer, and the generation prompt is not);
* ``prompt-completion``: ``{"prompt": ..., "completion": ...}``: the text is the prompt
  followed by the completion, and the completion is the span.

Every problem is a ``RowError`` naming the file and line: a row that is not an object, a
chat row without ``messages``, a message without a role or text content, a template error (a
role it does not know, when it raises) or a message it leaves out of the text (a role it
skips), a template whose rendering of a conversation does not extend its rendering of the
conversation's beginning (the spans would be wrong), and an example with nothing to learn (no
assistant message, an empty completion).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NoReturn, Protocol

from speedtronic.data.text import DataSourceError
from speedtronic.data.tokenizer import require_module

__all__ = ["ChatTemplate", "Example", "RowError", "RowFormat", "load_chat_template", "render_row"]

RowFormat = Literal["chat", "prompt-completion"]
Span = tuple[int, int]
_MAX_TEMPLATE_BYTES = 1 << 20
_TRAINED_ROLE = "assistant"


class RowError(DataSourceError):
    """A row (or the template rendering it) that cannot make a training example."""


@dataclass(frozen=True)
class Example:
    """A rendered row: its text and the character spans of the text that carry the loss."""

    text: str
    spans: tuple[Span, ...]


class _Template(Protocol):
    def new_context(self, vars: dict[str, object], shared: bool) -> object: ...
    def root_render_func(self, context: object) -> Iterator[str]: ...


class ChatTemplate:
    """A compiled chat template and the special-token strings it is rendered with."""

    def __init__(self, source: str, where: str, variables: Mapping[str, str]) -> None:
        jinja2 = require_module("jinja2", f"the chat template {where}")
        sandbox = require_module("jinja2.sandbox", f"the chat template {where}")
        environment = sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        environment.globals["raise_exception"] = _raise_exception
        self.where = where
        self.variables = dict(variables)
        # What ``Template.render`` would merge for every call, merged once: a render is
        # then a third of the cost (a shared context, no chain of globals to walk).
        self._values: dict[str, object] = {**environment.globals, **self.variables}
        try:
            self._template: _Template = environment.from_string(source)
        except jinja2.TemplateError as exc:
            raise DataSourceError(f"{where}: not a usable Jinja template ({exc})") from None

    def render(self, messages: Sequence[Mapping[str, object]], generation_prompt: bool) -> str:
        """The text of ``messages`` (a ``TemplateError`` or ``_TemplateRefusal`` raises)."""
        values = {
            **self._values,
            "messages": list(messages),
            "add_generation_prompt": generation_prompt,
        }
        context = self._template.new_context(values, shared=True)
        return "".join(self._template.root_render_func(context))


class _TemplateRefusal(Exception):
    """``raise_exception(message)`` called by a template."""


def _raise_exception(message: object) -> NoReturn:
    raise _TemplateRefusal(str(message))


def load_chat_template(tokenizer: str, template_file: str | None) -> ChatTemplate:
    """The template of ``--chat-template`` (a Jinja file), else the ``chat_template`` of the
    ``tokenizer_config.json`` next to ``tokenizer`` (the ``default`` one of a list). Its
    ``bos_token``/``eos_token`` strings come from that config when it exists."""
    config_path = Path(tokenizer).parent / "tokenizer_config.json"
    config = _read_config(config_path) if tokenizer != "bytes" and config_path.is_file() else {}
    variables = {
        name: value
        for name in ("bos_token", "eos_token")
        if isinstance(value := _token_text(config.get(name)), str)
    }
    if template_file is not None:
        path = Path(template_file)
        if not path.is_file():
            raise DataSourceError(f"--chat-template {template_file}: no such file")
        if path.stat().st_size > _MAX_TEMPLATE_BYTES:
            raise DataSourceError(f"--chat-template {template_file}: larger than 1 MiB")
        try:
            source = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise DataSourceError(
                f"--chat-template {template_file}: invalid UTF-8 at byte {exc.start}"
            ) from None
        return ChatTemplate(source, f"--chat-template {template_file}", variables)
    configured = _config_template(config.get("chat_template"))
    if configured is None:
        where = str(config_path) if config else f"{tokenizer} (no tokenizer_config.json beside it)"
        raise DataSourceError(
            f"{where} has no chat template: pass --chat-template with a Jinja template file"
        )
    return ChatTemplate(configured, f"{config_path}: chat_template", variables)


def _read_config(path: Path) -> dict[str, object]:
    if path.stat().st_size > 16 * _MAX_TEMPLATE_BYTES:
        raise DataSourceError(f"{path}: larger than 16 MiB, not a tokenizer config")
    try:
        values = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataSourceError(f"{path}: not a JSON tokenizer config ({exc})") from None
    if not isinstance(values, dict):
        raise DataSourceError(f"{path}: not a JSON object")
    return values


def _token_text(value: object) -> str | None:
    """A special token as the config gives it: a string, or ``{"content": ...}``."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _config_template(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # named templates: [{"name": ..., "template": ...}]
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        found = named.get("default")
        return found if isinstance(found, str) else None
    return None


def render_row(
    row_format: RowFormat, row: object, where: str, template: ChatTemplate | None
) -> Example:
    """The example of one parsed JSONL row (``where`` is ``file:line``)."""
    if not isinstance(row, dict):
        raise RowError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    if row_format == "prompt-completion":
        return _prompt_completion(row, where)
    assert template is not None  # the caller loads it for chat rows
    return _chat(row, where, template)


def _prompt_completion(row: Mapping[str, object], where: str) -> Example:
    prompt, completion = row.get("prompt"), row.get("completion")
    for key, value in (("prompt", prompt), ("completion", completion)):
        if not isinstance(value, str):
            found = "no" if value is None else f"a {type(value).__name__} as"
            raise RowError(f"{where}: {found} {key!r}: prompt-completion rows need two strings")
    assert isinstance(prompt, str) and isinstance(completion, str)
    if not completion:
        raise RowError(f"{where}: the completion is empty: the example has no token to learn")
    return Example(prompt + completion, ((len(prompt), len(prompt) + len(completion)),))


def _messages(row: Mapping[str, object], where: str) -> list[dict[str, object]]:
    messages = row.get("messages")
    if messages is None:
        keys = ", ".join(repr(key) for key in list(row)[:5]) or "none"
        raise RowError(f"{where}: no 'messages' (the row has {keys}); chat rows need a list")
    if not isinstance(messages, list) or not messages:
        raise RowError(f"{where}: 'messages' must be a non-empty list of messages")
    checked: list[dict[str, object]] = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RowError(f"{where}: messages[{index}] is not an object")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise RowError(f"{where}: messages[{index}] has no 'role'")
        if not isinstance(content, str):
            raise RowError(f"{where}: messages[{index}] ({role}) has no text 'content'")
        checked.append(message)
    if not any(message["role"] == _TRAINED_ROLE for message in checked):
        raise RowError(f"{where}: no {_TRAINED_ROLE!r} message: the example has no token to learn")
    return checked


def _chat(row: Mapping[str, object], where: str, template: ChatTemplate) -> Example:
    messages = _messages(row, where)
    render = _renderer(template, where)
    text = render(messages, False)
    _check_every_message_shows(messages, text, where)
    spans: list[Span] = []
    for index, message in enumerate(messages):
        if message["role"] != _TRAINED_ROLE:
            continue
        before = render(messages[:index], True)
        last = index == len(messages) - 1
        through = text if last else render(messages[: index + 1], False)
        if not (through.startswith(before) and text.startswith(through)):
            raise RowError(
                f"{where}: {template.where} renders messages[{index}] ({_TRAINED_ROLE}) so that "
                "the conversation's text does not extend its beginning's: the answer's tokens "
                "cannot be told apart"
            )
        if len(through) > len(before):
            spans.append((len(before), len(through)))
    if not spans:
        raise RowError(f"{where}: every {_TRAINED_ROLE!r} message renders empty: nothing to learn")
    return Example(text, tuple(spans))


def _renderer(
    template: ChatTemplate, where: str
) -> Callable[[Sequence[Mapping[str, object]], bool], str]:
    def render(messages: Sequence[Mapping[str, object]], prompt: bool) -> str:
        try:
            return template.render(messages, prompt)
        except _TemplateRefusal as exc:
            raise RowError(f"{where}: {template.where} refused the row: {exc}") from None
        except Exception as exc:  # a TemplateError, or the template's own TypeError...
            raise RowError(f"{where}: {template.where} failed on the row ({exc})") from None

    return render


def _check_every_message_shows(
    messages: Sequence[Mapping[str, object]], text: str, where: str
) -> None:
    """A template that silently skips a role it does not know would train on a
    conversation without that message: refuse it."""
    position = 0
    for index, message in enumerate(messages):
        content = str(message["content"])
        found = text.find(content, position) if content else position
        if found < 0:
            raise RowError(
                f"{where}: messages[{index}] has the role {message['role']!r}, which the chat "
                "template does not render (its content is not in the text)"
            )
        position = found + len(content)
