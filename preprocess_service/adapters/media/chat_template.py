"""Conversations rendered with the tokenizer's own chat template (``chat_template`` in the
``tokenizer_config.json`` beside a ``tokenizer.json``, or a ``chat_template.jinja`` file there),
as the model will see them at inference, in a sandbox.

How the mask is made ("rendered spans"): each turn's content is replaced by a sentinel
(``\\ue000<i>\\ue001``, private-use characters no template writes) and the conversation is rendered
once. What the template wrote between sentinels is its own text: never trained, and tokenized
with its special tokens (``<|start_header_id|>``, ``<|im_start|>``, ``[INST]`` ...) recognised. Each
sentinel becomes its turn's content again: text pieces (trained for the assistant only, tokenized
with special tokens read as text, so data cannot forge one) and ``<image>`` slots where the turn
has them. The special token the template writes right after an assistant's content (``<|eot_id|>``,
``<|im_end|>``, ``</s>``) is trained too: the model learns to stop.

Bounds (a template is data: it comes with a tokenizer file a job names):
- Jinja's ImmutableSandboxedEnvironment (no attribute of ``__class__``, no mutation of what the
  template is given, ``range`` at most 100,000);
- at most MAX_TEMPLATE_CHARS of template, MAX_RENDER_CHARS of output, RENDER_TIME_S per render
  (a loop that writes nothing is stopped too: a trace function checks the clock);
- a template that fails its probe render when the tokenizer loads is refused (TemplateError).
"""

from __future__ import annotations

import re
import sys
import time

from disttrain_api.errors import SampleError
from preprocess_service.adapters.media.conversations import ImageSlot, Piece, TextPiece

MAX_TEMPLATE_CHARS = 64 << 10
MAX_RENDER_CHARS = 1 << 20
RENDER_TIME_S = 1.0
FIXED_DATE = "26 Jul 2024"
"""What ``strftime_now`` gives a template (Llama-3.1 writes today's date): fixed, so plans repeat."""
_SENTINEL = re.compile("\ue000(\\d+)\ue001")
PROBES = ([("system", ["Be brief."]), ("user", ["Hi", ImageSlot()]), ("assistant", ["Hello."]),
           ("user", ["Bye"]), ("assistant", ["Bye."])],
          [("user", ["Hi"]), ("assistant", ["Hello."])])
"""Conversations a template must render when it loads (the second for templates without a system role)."""


class TemplateError(ValueError):
    """A chat template that cannot be used; the message names the problem."""


class _Deadline(Exception):
    pass


class ChatTemplate:
    """A compiled chat template and the special tokens around it."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", specials: tuple[str, ...] = ()):
        from jinja2 import TemplateError as JinjaError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if not isinstance(source, str) or not source.strip():
            raise TemplateError("the chat template is empty")
        if len(source) > MAX_TEMPLATE_CHARS:
            raise TemplateError(f"the chat template is {len(source)} characters, more than {MAX_TEMPLATE_CHARS}")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, autoescape=False)

        def raise_exception(message):
            raise TemplateError(f"the chat template raised: {str(message)[:200]}")

        env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt="": FIXED_DATE)
        try:
            self._template = env.from_string(source)
        except JinjaError as exc:
            raise TemplateError(f"the chat template does not compile: {exc}") from None
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token
        self.specials = tuple(sorted({s for s in specials if s}, key=len, reverse=True))
        self._special = re.compile("|".join(map(re.escape, self.specials))) if self.specials else None
        failures = []
        for probe in PROBES:
            try:
                self.pieces(probe)
                break
            except SampleError as exc:
                failures.append(exc.reason)
        else:
            raise TemplateError(f"the chat template fails on a plain conversation: {failures[-1]}")

    def render(self, messages: list[dict]) -> str:
        """The template's output for ``messages``, within the output and time bounds
        (SampleError of kind invalid_conversation otherwise)."""
        from jinja2 import TemplateError as JinjaError

        deadline = time.monotonic() + RENDER_TIME_S
        previous = sys.gettrace()

        def tracer(frame, event, arg):  # also stops a loop that writes nothing
            if time.monotonic() > deadline:
                raise _Deadline
            return tracer

        out: list[str] = []
        size = 0
        sys.settrace(tracer)
        try:
            for chunk in self._template.generate(messages=messages, add_generation_prompt=False,
                                                 bos_token=self.bos_token, eos_token=self.eos_token):
                size += len(chunk)
                if size > MAX_RENDER_CHARS:
                    raise _invalid(f"the chat template wrote more than {MAX_RENDER_CHARS} characters")
                out.append(chunk)
        except _Deadline:
            raise _invalid(f"the chat template took more than {RENDER_TIME_S} s") from None
        except TemplateError as exc:
            raise _invalid(str(exc)) from None
        except (JinjaError, RecursionError, TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
            raise _invalid(f"the chat template failed ({type(exc).__name__}: {str(exc)[:200]})") from None
        finally:
            sys.settrace(previous)
        return "".join(out)

    def pieces(self, turns: list[tuple[str, list]]) -> list[Piece]:
        """A conversation (role, content parts: text and ImageSlot) rendered as pieces in order."""
        messages = [{"role": role, "content": f"\ue000{i}\ue001"} for i, (role, _) in enumerate(turns)]
        text = self.render(messages)
        if self.bos_token and text.startswith(self.bos_token):  # the document begins with its own BOS
            text = text[len(self.bos_token):]
        pieces: list[Piece] = []
        at, after_assistant = 0, False
        for match in _SENTINEL.finditer(text):
            self._template_text(text[at:match.start()], pieces, after_assistant)
            index = int(match.group(1))
            if index >= len(turns):
                raise _invalid("the chat template wrote a marker of a turn that does not exist")
            role, parts = turns[index]
            member = f"json:turn[{index}]"
            for part in parts:
                if isinstance(part, ImageSlot):
                    pieces.append(part)
                elif part:
                    pieces.append(TextPiece(member, part, trainable=role == "assistant"))
            at, after_assistant = match.end(), role == "assistant"
        self._template_text(text[at:], pieces, after_assistant)
        if not any(isinstance(p, TextPiece) and p.trainable for p in pieces) and \
                any(role == "assistant" for role, _ in turns):
            raise _invalid("the chat template left out every assistant turn")
        return pieces

    def _template_text(self, text: str, pieces: list[Piece], after_assistant: bool) -> None:
        if not text:
            return
        if after_assistant and self._special is not None:  # the end-of-turn token right after the answer
            match = self._special.match(text)
            if match:
                pieces.append(TextPiece("template", match.group(0), trainable=True, special=True))
                text = text[match.end():]
        if text:
            pieces.append(TextPiece("template", text, trainable=False, special=True))


def _invalid(reason: str) -> SampleError:
    return SampleError("", f"conversation: {reason}", kind="invalid_conversation")
