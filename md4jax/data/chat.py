"""Chat templates: a released model's Jinja template (tokenizer_config.json's chat_template)
rendered around a user's message, as Hugging Face's apply_chat_template renders it.

The template runs in Jinja's sandbox (a template is code a downloaded folder ships). The special
tokens it names (bos_token, eos_token, ...) are bound when the template is stored
(`with_special_tokens`), so a workdir's config holds everything the rendering needs.
"""

import json

import jinja2
import jinja2.sandbox

# The special-token fields of tokenizer_config.json a template may name.
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token")


def _token_text(value) -> str:
  """A special token's text: tokenizer_config.json writes a string or an AddedToken dict."""
  return value["content"] if isinstance(value, dict) else str(value)


def with_special_tokens(template: str, tokenizer_config: dict) -> str:
  """The template with the folder's special tokens set at its top (Jinja `set`s)."""
  bound = [
    f"{{% set {name} = {json.dumps(_token_text(tokenizer_config[name]))} %}}"
    for name in SPECIAL_TOKENS
    if tokenizer_config.get(name) is not None  # (null: the tokenizer has none)
  ]
  return "".join(bound) + template


def template_of(tokenizer_config: dict) -> str:
  """tokenizer_config.json's chat template ("" without one; the "default" of named ones)."""
  template = tokenizer_config.get("chat_template") or ""
  if isinstance(template, list):  # Named templates: [{"name": ..., "template": ...}].
    named = {entry["name"]: entry["template"] for entry in template}
    template = named["default"] if "default" in named else ""
  return with_special_tokens(template, tokenizer_config) if template else ""


def apply(template: str, message: str) -> str:
  """The text of one user message followed by the assistant's turn; ValueError naming the
  template's error."""

  def raise_exception(text):  # Templates call it to refuse a conversation.
    raise jinja2.TemplateError(text)

  environment = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  environment.globals["raise_exception"] = raise_exception
  try:
    return environment.from_string(template).render(
      messages=[{"role": "user", "content": message}], add_generation_prompt=True
    )
  except jinja2.TemplateError as e:
    raise ValueError(f"The chat template does not render: {e}") from None
