"""The checkpoint's tokenizer as lm-evaluation-harness' ``hf`` backend sees it: ids, special tokens, text.

lm_eval's HF backend wraps transformers' fast tokenizer, which is the ``tokenizers`` model of
``tokenizer.json`` plus what ``tokenizer_config.json`` (and ``special_tokens_map.json``) say about
it: which tokens are BOS, EOS, UNK and padding, whether decoding cleans up spaces before
punctuation. This module reads the same files from the checkpoint's source
and answers the same questions, so the backend tokenizes exactly as the reference does:

* ``encode(text, add_special_tokens)``: the post-processor's special tokens (a BOS, for most
  checkpoints) are added unless told not to, as ``tokenizer.encode`` does;
* ``decode(ids, skip_special_tokens)``: special tokens dropped by default, then transformers'
  ``clean_up_tokenization`` when the config asks for it (not for BPE models unless forced, as
  transformers 5 decides);
* ``bos_id`` / ``eos_id`` / ``pad_id``: from the token strings of the tokenizer config; the
  checkpoint's ``config.json`` ids when the tokenizer config names none (transformers would have
  none there, and lm_eval could not score an empty context);
* ``chat_template``: the tokenizer config's ``chat_template`` (a list of named ones becomes a
  dict), overridden by a ``chat_template.jinja`` file and completed by the named ones of
  ``additional_chat_templates/*.jinja``, as transformers loads them; ``special_tokens_map`` the
  named special tokens' texts a chat template sees (``bos_token``, ``eos_token``, ...).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from otfload.errors import TokenizerError
from otfload.sources import Source, read_bytes
from otfload.tokenizer import tokenizer_from_source

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# The named special tokens transformers passes to a chat template (its SPECIAL_TOKENS_ATTRIBUTES).
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Larger than any published tokenizer_config.json (chat templates make some ~100 kB); refuse more.
MAX_CONFIG_BYTES = 16 << 20
FORCE_BPE_CLEAN_UP = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
# transformers' ``clean_up_tokenization``: a space before these is removed when decoding asks for it.
CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
            (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class CheckpointTokenizer:
    """``tokenizer.json`` with the special tokens and decoding options of ``tokenizer_config.json``."""

    def __init__(self, tokenizer: Tokenizer, tokenizer_config: Mapping[str, Any],
                 model_config: Mapping[str, Any], chat_templates: Mapping[str, str] | None = None) -> None:
        """``chat_templates``: templates from files (``"default"``: ``chat_template.jinja``), which
        take precedence over the tokenizer config's."""
        self.tokenizer = tokenizer
        # transformers (5.x) skips the clean-up for BPE models, which it would corrupt, unless forced.
        forced = bool(tokenizer_config.get(FORCE_BPE_CLEAN_UP, False))
        self.clean_up_spaces = bool(tokenizer_config.get("clean_up_tokenization_spaces", False)) and (
            forced or type(tokenizer.model).__name__ != "BPE")
        self.bos_id = self._special(tokenizer_config, "bos_token", model_config.get("bos_token_id"))
        self.eos_id = self._special(tokenizer_config, "eos_token", _first(model_config.get("eos_token_id")))
        self.unk_id = self._special(tokenizer_config, "unk_token", None)
        pad = self._special(tokenizer_config, "pad_token", model_config.get("pad_token_id"))
        # lm_eval's configure_pad_token: the UNK token, else EOS, when the tokenizer names no padding.
        self.pad_id = next((t for t in (pad, self.unk_id, self.eos_id) if t is not None), 0)
        self.special_tokens_map = {key: text for key in NAMED_SPECIAL_TOKENS
                                   if (text := _token_text(tokenizer_config, key)) is not None}
        self.chat_template = _chat_templates(tokenizer_config.get("chat_template"), chat_templates or {})

    def _special(self, config: Mapping[str, Any], key: str, fallback: int | None) -> int | None:
        token = _token_text(config, key)
        if token is None:
            return fallback
        found = self.tokenizer.token_to_id(token)
        if found is None:
            raise TokenizerError(f"{TOKENIZER_CONFIG}: {key} {token!r} is not in tokenizer.json's vocabulary")
        return int(found)

    @property
    def bos_token(self) -> str | None:
        """The BOS token's text (``None`` without one)."""
        return None if self.bos_id is None else self.tokenizer.id_to_token(self.bos_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text: str = self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up_spaces:
            for before, after in CLEAN_UP:
                text = text.replace(before, after)
        return text


def checkpoint_tokenizer(source: Source, model_config: Mapping[str, Any]) -> CheckpointTokenizer:
    """The tokenizer of the checkpoint in ``source`` (left open), with its ``config.json`` as
    ``model_config`` (the fallback for special-token ids)."""
    config: dict[str, Any] = {}
    files = set(source.list_files())
    for name in (SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG):  # the tokenizer config wins where both say
        if name in files:
            config.update(_json_object(source, name))
    templates = {"default" if name == CHAT_TEMPLATE_FILE else name.split("/")[-1].removesuffix(".jinja"):
                 _text(source, name) for name in sorted(files) if _is_chat_template(name)}
    return CheckpointTokenizer(tokenizer_from_source(source), config, model_config, templates)


def _is_chat_template(name: str) -> bool:
    """``chat_template.jinja`` or a named template ``additional_chat_templates/NAME.jinja``."""
    return name == CHAT_TEMPLATE_FILE or (name.startswith(f"{CHAT_TEMPLATE_DIR}/") and name.endswith(".jinja"))


def _token_text(config: Mapping[str, Any], key: str) -> str | None:
    """The text of special token ``key`` as a tokenizer config writes it: a string or an AddedToken object."""
    token = config.get(key)
    if isinstance(token, dict):  # an AddedToken written out: {"content": "<s>", ...}
        token = token.get("content")
    if token is not None and not isinstance(token, str):
        raise TokenizerError(f"{TOKENIZER_CONFIG}: {key} must be a token string, got {token!r}")
    return token


def _chat_templates(configured: Any, files: Mapping[str, str]) -> str | dict[str, str] | None:
    """The checkpoint's chat template (one string) or named templates (a dict), as transformers
    resolves them: the config's, then the files' (``"default"`` replaces a single configured one)."""
    templates: str | dict[str, str] | None
    if isinstance(configured, list):  # [{"name": ..., "template": ...}, ...]
        try:
            templates = {str(t["name"]): str(t["template"]) for t in configured}
        except (TypeError, KeyError):
            raise TokenizerError(f"{TOKENIZER_CONFIG}: chat_template must be a string or a list of "
                                 "{name, template} objects") from None
    elif configured is None or isinstance(configured, str):
        templates = configured
    else:
        raise TokenizerError(f"{TOKENIZER_CONFIG}: chat_template must be a string, got {type(configured).__name__}")
    if not files:
        return templates
    if set(files) == {"default"}:
        return files["default"]
    return {**(templates if isinstance(templates, dict) else {}), **files}


def _text(source: Source, name: str) -> str:
    size = source.size(name)
    if size > MAX_CONFIG_BYTES:
        raise TokenizerError(f"{name} in {source.description}: {size} bytes is too large for a chat template")
    try:
        return read_bytes(source, name).decode("utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{name} in {source.description}: not UTF-8 text ({e})") from None


def _json_object(source: Source, name: str) -> dict[str, Any]:
    size = source.size(name)
    if size > MAX_CONFIG_BYTES:
        raise TokenizerError(f"{name} in {source.description}: {size} bytes is too large for a tokenizer config")
    try:
        data = json.loads(read_bytes(source, name))
    except (ValueError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{name} in {source.description}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{name} in {source.description}: expected a JSON object, got {type(data).__name__}")
    return data


def _first(ids: Any) -> int | None:
    """``config.json``'s ``eos_token_id`` may be one id or a list: the first."""
    if isinstance(ids, list):
        return int(ids[0]) if ids else None
    return None if ids is None else int(ids)
