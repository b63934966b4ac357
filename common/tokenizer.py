"""Torch-free tokenizer: `tokenizer.json` loading, encode/decode and the chat template."""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import jinja2
import tokenizers
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import processors

# This module is imported by the router, which must never load torch: stdlib, `tokenizers` and
# `jinja2` only.


class TokenizerFileNotFoundError(FileNotFoundError):
    """A tokenizer directory or a required file in it is missing; the message names the path."""


class TokenizerLoadError(ValueError):
    """A tokenizer file exists but cannot be parsed; the message names the file."""


class ChatTemplateError(ValueError):
    """No chat template, a template that does not compile, or one that refused the messages."""


class Tokenizer:
    """A fast (tokenizer.json) tokenizer plus the HF side files: special tokens and chat templates.

    Chat templates usually render their own BOS, so tokenize a rendered chat with
    `add_special_tokens=False` (or use `encode_chat`), as HF's `apply_chat_template` does.
    Decoding never applies `clean_up_tokenization_spaces`: it is lossy and would make streamed
    text differ from the final text.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        name_or_path: str = "",
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_templates: dict[str, str] | None = None,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._backend = backend
        self._name_or_path = name_or_path
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._chat_templates = dict(chat_templates or {})
        self._compiled: dict[str, jinja2.Template] = {}
        # Like transformers: the tokenizer's own BOS, None where it has none (Qwen), even though
        # config.json may still name a bos_token_id.
        self._bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        eos_ids = [backend.token_to_id(eos_token)] if eos_token else []
        self._eos_token_ids = tuple(dict.fromkeys(i for i in [*eos_ids, *extra_eos_token_ids] if i is not None))

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load tokenizer.json and, where present, tokenizer_config.json, chat template files and
        the eos ids of generation_config.json / config.json."""
        root = Path(path)
        if not root.is_dir():
            raise TokenizerFileNotFoundError(f"tokenizer directory {str(root)!r} does not exist or is not a directory")
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerFileNotFoundError(
                f"{tok_file}: missing tokenizer.json (only fast tokenizers in tokenizer.json form are supported)"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises a bare Exception
            raise TokenizerLoadError(f"{tok_file}: cannot be parsed ({e})") from e

        cfg = _read_json(root / "tokenizer_config.json")
        bos, eos = _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token"))
        # Mirror transformers: explicit add_bos/add_eos flags (or no post-processor at all)
        # rebuild the post-processor, overriding what tokenizer.json says.
        if "add_bos_token" in cfg or "add_eos_token" in cfg or backend.post_processor is None:
            _set_template_processor(
                backend, bos if cfg.get("add_bos_token") else None, eos if cfg.get("add_eos_token") else None
            )

        extra_eos: list[int] = []
        for side_file in ("generation_config.json", "config.json"):
            extra_eos += _as_id_list(_read_json(root / side_file).get("eos_token_id"))
        return cls(
            backend,
            name_or_path=str(root),
            bos_token=bos,
            eos_token=eos,
            chat_templates=_load_chat_templates(root, cfg),
            extra_eos_token_ids=extra_eos,
        )

    @property
    def name_or_path(self) -> str:
        return self._name_or_path

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: the tokenizer's eos plus generation_config/config ones."""
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer can produce, added tokens included (the model's embedding may be larger)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    @property
    def has_chat_template(self) -> bool:
        return bool(self._chat_templates)

    @property
    def chat_template_sources(self) -> tuple[str, ...]:
        """The text of every chat template (the router reads the tool-call format from it)."""
        return tuple(self._chat_templates.values())

    def set_chat_template(self, source: str) -> None:
        """Replace the tokenizer's chat templates (every name) with `source`, compiled now."""
        self._compiled = {"default": compile_chat_template(source, "--chat-template")}
        self._chat_templates = {"default": source}

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        template_name: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` with the model's chat template, with the variables HF templates expect."""
        template = self._template(template_name, has_tools=bool(tools))
        try:
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                documents=documents,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"{self._name_or_path}: chat template failed: {e}") from e

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Render and tokenize a chat; the template supplies any BOS, so none is added here."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def _template(self, name: str | None, *, has_tools: bool) -> jinja2.Template:
        if not self._chat_templates:
            raise ChatTemplateError(
                f"tokenizer {self._name_or_path!r} has no chat template (tokenizer_config.json has no "
                "chat_template and there is no chat_template.jinja); use a plain completion prompt instead"
            )
        if name is None:
            # As transformers does: a "tool_use" template wins when tools are given.
            name = "tool_use" if has_tools and "tool_use" in self._chat_templates else "default"
            if name not in self._chat_templates:
                name = next(iter(self._chat_templates))
        if name not in self._chat_templates:
            raise ChatTemplateError(
                f"no chat template named {name!r}; available: {', '.join(sorted(self._chat_templates))}"
            )
        if name not in self._compiled:
            self._compiled[name] = compile_chat_template(
                self._chat_templates[name], f"{self._name_or_path}: template {name!r}"
            )
        return self._compiled[name]


def load_chat_template(value: str) -> str:
    """A --chat-template value as template text: inline when it holds a Jinja tag, else a file's
    contents; compiled here, so a missing or broken template fails at start-up."""
    source = value
    if "{{" not in value and "{%" not in value:
        path = Path(value)
        if not path.is_file():
            raise ChatTemplateError(f"--chat-template {value!r}: no such file (an inline template holds {{{{ or {{%)")
        source = path.read_text(encoding="utf-8")
    compile_chat_template(source, f"--chat-template {value if source is not value else 'inline template'}")
    return source


def compile_chat_template(source: str, origin: str) -> jinja2.Template:
    """The template compiled in the chat environment; ChatTemplateError naming `origin` if it does not."""
    try:
        return _jinja_env().from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"{origin}: chat template does not compile: {e}") from e


def _jinja_env() -> ImmutableSandboxedEnvironment:
    """The environment HF chat templates are written for: sandboxed, trimmed blocks, loop controls,
    a non-escaping `tojson`, `raise_exception` and `strftime_now`."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes (<, >, &, '), which would corrupt tool schemas in prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template refused the messages: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker) renders its body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _read_json(path: Path) -> dict[str, Any]:
    """An optional side file: {} when absent, a clear error when malformed."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerLoadError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise TokenizerLoadError(f"{path}: expected a JSON object")
    return data


def _token_str(value: Any) -> str | None:
    """Special tokens are stored as plain strings or as serialized AddedToken dicts."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _set_template_processor(backend: tokenizers.Tokenizer, bos: str | None, eos: str | None) -> None:
    """Build the BOS/EOS post-processor the way transformers does from add_bos/add_eos flags."""
    specials: list[tuple[str, int]] = []
    for tok in (bos, eos):
        tid = backend.token_to_id(tok) if tok else None
        if tok and tid is not None:
            specials.append((tok, tid))
    names = {t for t, _ in specials}
    b = bos if bos in names else None
    e = eos if eos in names else None
    single = f"{f'{b}:0 ' if b else ''}$A:0{f' {e}:0' if e else ''}"
    pair = f"{single}{f' {b}:1' if b else ''} $B:1{f' {e}:1' if e else ''}"
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _load_chat_templates(root: Path, cfg: dict[str, Any]) -> dict[str, str]:
    """Named templates; separate template files win over tokenizer_config.json, as in transformers."""
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return {"default": jinja_file.read_text(encoding="utf-8")}
    source: Any = _read_json(root / "chat_template.json").get("chat_template") or cfg.get("chat_template")
    if isinstance(source, str):
        return {"default": source} if source else {}
    if isinstance(source, list):
        # [{"name": ..., "template": ...}, ...]
        return {
            str(t["name"]): str(t["template"])
            for t in source
            if isinstance(t, dict) and t.get("name") and t.get("template")
        }
    return {}
