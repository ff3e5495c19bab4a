"""Tasks to prompt token ids, as production would send them: through the target's chat template (with its thinking
setting) or as raw text. The template and the setting shape acceptance (thinking on roughly halves τ in reports),
so both are recorded and part of every cache key::

    prompts = PromptBuilder(tokenizer, PromptSettings(format="chat", thinking=False, ...)).ids(task)
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

from dfserve.errors import FieldError
from dfserve.eval.records import PromptSettings
from dfserve.tasks import Task


def prompt_settings(tokenizer: Any, format: Literal["chat", "raw"], thinking: bool) -> PromptSettings:
    """The settings of this run, with the hash of the chat template it will use; a chat format needs one."""
    template = getattr(tokenizer, "chat_template", None) if format == "chat" else None
    if format == "chat" and not isinstance(template, str):
        raise FieldError("prompt_format", "chat: the target's tokenizer has no chat template; use raw prompts")
    digest = hashlib.sha256(template.encode()).hexdigest() if isinstance(template, str) else None
    return PromptSettings(format=format, thinking=thinking, template_sha256=digest)


def prompt_ids(tokenizer: Any, settings: PromptSettings, task: Task) -> list[int]:
    """One task's prompt tokens: the chat template applied to its messages (a generation prompt added), or its
    text tokenized as SGLang's native `/generate` would."""
    if settings.format == "chat":
        rendered = tokenizer.apply_chat_template(task.as_messages(), tokenize=False, add_generation_prompt=True,
                                                 enable_thinking=settings.thinking)
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return list(tokenizer(task.as_text())["input_ids"])
