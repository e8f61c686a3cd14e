"""Chat conversations as tokens with the assistant's tokens marked: what a chat fine-tune trains on.

A conversation is rendered with the tokenizer's chat template (or, without one, the fallback
``<|{role}|>\\n{content}\\n`` per message). Which tokens are targets:

* ``trainOn: all``: every token.
* ``trainOn: assistant``: the assistant turns only. A template with ``{% generation %}`` blocks says so
  itself (``apply_chat_template(..., return_assistant_tokens_mask=True)``). Other templates (those of
  Llama 3, Qwen 2.5 and Gemma among them) are rendered turn by turn: the tokens of ``messages[:i+1]`` past
  those of ``messages[:i]`` are message ``i``'s. Of an assistant turn, the header that opens it (what
  ``add_generation_prompt=True`` adds after ``messages[:i]``) is context, and its content and
  end-of-turn token (``<|eot_id|>``, ``<|im_end|>``, ``<end_of_turn>``) are targets; the whitespace a
  template writes after the end-of-turn token is not (the model never generates it). System, user and
  tool turns are context.

Turn-by-turn rendering needs every rendering to extend the previous one token for token; a template that
rewrites earlier turns (e.g. one that drops past reasoning) breaks that, and the record is refused with a
:class:`ChatTemplateError` naming it rather than trained on misattributed tokens.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from memfit.api.vocabulary import TrainOn
from memfit_trainer.records import messages_problem

ASSISTANT_ROLE = "assistant"
GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""How a chat template marks the assistant's text (``transformers``' ``{% generation %}`` extension)."""


class ChatTemplateError(ValueError):
    """A conversation cannot be rendered or attributed to its turns; the message names the record."""


@dataclass(frozen=True)
class Tokens:
    """A document's token ids and, for each, whether it is a training target."""

    ids: list[int]
    trained: list[bool]


def check_messages(messages: Any, record: str) -> list[Mapping[str, str]]:
    """``messages`` as a list of ``{"role": str, "content": str}``, or a ChatTemplateError naming ``record``."""
    problem = messages_problem(messages)
    if problem is not None:
        raise ChatTemplateError(f"{record}: a chat record must be a non-empty list of {{'role': str, 'content': str}}: "
                                f"{problem}")  # fmt: skip
    return cast(list[Mapping[str, str]], messages)


def fallback_rendering(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool) -> str:
    """The documented rendering for tokenizers without a chat template."""
    text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    return text + (f"<|{ASSISTANT_ROLE}|>\n" if add_generation_prompt else "")


class ConversationTokenizer:
    """Tokenises conversations with the tokenizer's chat template and marks the targets (module docstring)."""

    def __init__(self, tokenizer: Any, train_on: TrainOn) -> None:
        self.tokenizer = tokenizer
        self.train_on = train_on
        template = getattr(tokenizer, "chat_template", None)
        self.has_template = bool(template)
        self.marks_generation = isinstance(template, str) and GENERATION_BLOCK.search(template) is not None

    def _render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool, record: str) -> list[int]:
        if not self.has_template:
            text = fallback_rendering(messages, add_generation_prompt)
        else:
            try:
                text = self.tokenizer.apply_chat_template(
                    list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
                )
            except Exception as exc:  # jinja's TemplateError, raise_exception(), KeyError in a template...
                raise ChatTemplateError(f"{record}: the chat template refuses this conversation: {exc}") from exc
        # A template writes its own BOS and role tokens; the fallback rendering is plain text.
        return cast(list[int], self.tokenizer(text, add_special_tokens=not self.has_template)["input_ids"])

    def __call__(self, messages: Any, record: str) -> Tokens:
        """The conversation's tokens and targets; ``record`` names it in errors (e.g. ``file.jsonl record 12``)."""
        turns = check_messages(messages, record)
        if self.train_on == TrainOn.ALL:
            ids = self._render(turns, False, record)
            tokens = Tokens(ids, [True] * len(ids))
        elif self.marks_generation:
            return self._generation_marked(turns, record)
        else:
            tokens = self._turn_by_turn(turns, record)
        if self.has_template or self.tokenizer.eos_token_id is None:
            return tokens
        # The fallback rendering's only end marker, a target with the assistant turn it closes.
        last_trained = self.train_on == TrainOn.ALL or turns[-1]["role"] == ASSISTANT_ROLE
        return Tokens([*tokens.ids, int(self.tokenizer.eos_token_id)], [*tokens.trained, last_trained])

    def _generation_marked(self, turns: list[Mapping[str, str]], record: str) -> Tokens:
        try:
            out = self.tokenizer.apply_chat_template(
                turns, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
        except Exception as exc:
            raise ChatTemplateError(f"{record}: the chat template refuses this conversation: {exc}") from exc
        return Tokens(list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]])

    def _turn_by_turn(self, turns: list[Mapping[str, str]], record: str) -> Tokens:
        ids: list[int] = []
        trained: list[bool] = []
        for i, message in enumerate(turns):
            longer = self._render(turns[: i + 1], False, record)
            if longer[: len(ids)] != ids:
                raise ChatTemplateError(
                    f"{record}: the chat template renders messages 0..{i - 1} differently once message {i} "
                    "follows, so the tokens cannot be attributed to turns; use a template with {% generation %} "
                    "blocks or trainOn: all"
                )
            span = longer[len(ids) :]
            ids = longer
            if message["role"] != ASSISTANT_ROLE:
                trained += [False] * len(span)
                continue
            header = self._header(turns[:i], ids[: len(ids) - len(span)], record)
            if span[: len(header)] != header:
                raise ChatTemplateError(
                    f"{record}: assistant message {i} does not open with the template's generation prompt, so its "
                    "header cannot be told from its content"
                )
            end = len(span)
            while end > len(header) and not self.tokenizer.decode(span[end - 1 : end]).strip():
                end -= 1  # whitespace after the end-of-turn token: the model stops before it
            trained += [False] * len(header) + [True] * (end - len(header)) + [False] * (len(span) - end)
        return Tokens(ids, trained)

    def _header(self, before: list[Mapping[str, str]], before_ids: list[int], record: str) -> list[int]:
        """The tokens that open an assistant turn after ``before`` (``add_generation_prompt``)."""
        if not before:
            raise ChatTemplateError(
                f"{record}: the conversation opens with an assistant message; the template's header for it "
                "cannot be told from its content (start with a system or user message, or use trainOn: all)"
            )
        prompted = self._render(before, True, record)
        if prompted[: len(before_ids)] != before_ids:
            raise ChatTemplateError(
                f"{record}: the chat template's generation prompt changes the turns before it, so the "
                "assistant's header cannot be found"
            )
        return prompted[len(before_ids) :]
