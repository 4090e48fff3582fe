"""Chat templates rendered as transformers renders them, for lm_eval's ``--apply_chat_template``.

With ``apply_chat_template``, lm_eval builds each prompt as a list of messages (few-shot turns, the
question, for a loglikelihood request the answer as an assistant message to continue) and asks the
model to turn it into text; its ``hf`` backend calls ``tokenizer.apply_chat_template(messages,
tokenize=False, add_generation_prompt=..., continue_final_message=not add_generation_prompt)``.
This module does what that call does, without transformers: the checkpoint's Jinja template
(:func:`read_chat_templates`) compiled in transformers' sandboxed environment (``trim_blocks``,
``lstrip_blocks``, loop controls, its ``tojson``, ``raise_exception`` and ``strftime_now``),
rendered with ``messages``, ``add_generation_prompt`` and the tokenizer's named special tokens
(``bos_token``, ``eos_token``, ...); with ``continue_final_message`` the text is cut where the final
message's content ends, so the model continues it. As lm_eval's ``hf`` backend does, a template
that raises (many refuse a ``system`` turn) is rendered again without the system messages.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from otfload.errors import TokenizerError

# transformers' marker: appended to the final message, found in the rendered text, cut there.
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' ``tojson``: no HTML escaping (Jinja's own escapes ``<``, ``>``, ``&``, ``'``)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    """``source`` compiled once, in the sandboxed environment transformers renders chat templates in
    (a checkpoint's template is code from the Hub)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env.from_string(source)


def render_chat(template: str, messages: Sequence[Mapping[str, Any]], special_tokens: Mapping[str, str],
                add_generation_prompt: bool) -> str:
    """The prompt text of ``messages`` as lm_eval's ``hf`` backend makes it: a generation prompt
    after them, else the final message left open (continued by the model)."""
    try:
        return _render(template, messages, special_tokens, add_generation_prompt)
    except jinja2.exceptions.TemplateError:
        without_system = [m for m in messages if m.get("role") != "system"]
        if len(without_system) == len(messages):
            raise
        return _render(template, without_system, special_tokens, add_generation_prompt)


def _render(template: str, messages: Sequence[Mapping[str, Any]], special_tokens: Mapping[str, str],
            add_generation_prompt: bool) -> str:
    chat = [{k: v for k, v in m.items() if v is not None} for m in messages]  # transformers drops None fields
    final = None
    if not add_generation_prompt:  # continue the final message
        final = chat[-1].get("content") if chat else None
        if not isinstance(final, str):
            raise TokenizerError("a chat to continue needs a final message with text content; got "
                                 f"{chat[-1] if chat else 'no message'!r}")
        chat[-1] = {**chat[-1], "content": final + CONTINUE_TAG}
    text: str = compile_template(template).render(messages=chat, tools=None, documents=None,
                                                  add_generation_prompt=add_generation_prompt, **special_tokens)
    if final is None:
        return text
    tag = CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise TokenizerError("the chat template drops part of the final message, so it cannot be continued: "
                             f"{final.strip()!r} is not in {text!r}")
    at = text.rindex(tag)
    # A template that keeps the message's spacing shows the whole tag; one that strips it, not the space.
    return text[:at] if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()


def select_template(templates: str | Mapping[str, str] | None, name: str | None = None) -> str:
    """The template to render: the checkpoint's one, or of its named ones ``name`` (else
    ``"default"``), as transformers' ``get_chat_template`` picks it."""
    if templates is None:
        raise TokenizerError("the checkpoint has no chat template (tokenizer_config.json chat_template or "
                             "chat_template.jinja): it cannot be used with apply_chat_template")
    if isinstance(templates, str):
        return templates
    key = name if name is not None else "default"
    if key not in templates:
        raise TokenizerError(f"no chat template named {key!r}; the checkpoint has {sorted(templates)}")
    return templates[key]
