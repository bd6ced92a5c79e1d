"""Chat templates rendered on the client (jinja2, as Hugging Face tokenizers define them; no transformers).

The served models take text, so a chat request becomes one prompt string here. The template comes
from the target's tokenizer directory (`chat_template` in tokenizer_config.json, or
chat_template.jinja); without one, ChatML is used (the format of SmolLM2-Instruct and of the
tiny test tokenizers, whose vocabularies hold <|im_start|> and <|im_end|>).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """A chat template that cannot render the given messages."""


def _raise(message: str):
    raise TemplateError(message)


@dataclass
class ChatTemplate:
    """A jinja2 chat template plus the special tokens it may reference and the words that end a turn."""

    source: str = CHATML
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ...
    stop_words: list[str] = field(default_factory=lambda: ["<|im_end|>"])

    @classmethod
    def from_tokenizer_dir(cls, path: str | Path) -> "ChatTemplate":
        """The template of a Hugging Face tokenizer directory, or ChatML when it defines none."""
        path = Path(path)
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: take the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if source is None and (path / "chat_template.jinja").exists():
            source = (path / "chat_template.jinja").read_text()
        specials = {key: _token_text(config[key]) for key in ("bos_token", "eos_token", "pad_token")
                    if config.get(key)}
        if source is None:
            return cls(special_tokens=specials)
        stops = [specials["eos_token"]] if "eos_token" in specials else []
        if "<|im_end|>" in source and "<|im_end|>" not in stops:
            stops.append("<|im_end|>")
        return cls(source=source, special_tokens=specials, stop_words=stops)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...])."""
        for i, message in enumerate(messages):
            if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
                raise ChatTemplateError(f"messages[{i}] needs string 'role' and 'content' fields")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            return env.from_string(self.source).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                       **self.special_tokens)
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from None


def _token_text(token) -> str:
    """tokenizer_config.json stores special tokens as strings or as AddedToken dicts."""
    return token["content"] if isinstance(token, dict) else str(token)
