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
- at most MAX_TEMPLATE_CHARS of template, MAX_RENDER_CHARS of output and of any string an
  operator builds (``*``, ``+``, ``**`` checked before they run; ``%``-formatting and the
  width-taking string methods and filters refused), MAX_RENDER_STEPS line events per render
  (counted by a trace function: a loop that writes nothing is stopped too, and the count is the
  same on a loaded machine);
- a template that fails its probe render when the tokenizer loads is refused (TemplateError).
"""

from __future__ import annotations

import re
import resource
import sys
import time

from disttrain_api.errors import SampleError
from preprocess_service.adapters.media.conversations import MediaSlot, Piece, TextPiece

MAX_TEMPLATE_CHARS = 64 << 10
MAX_RENDER_CHARS = 1 << 20
"""Most characters a render writes, and the largest string or list any operation in it builds."""
MAX_RENDER_STEPS = 2_000_000
"""Most line events (the trace function's) one render may take: a count, so a render that fits on
a loaded machine fits on replay too."""
RENDER_TIME_S = 10.0
"""A wall-clock backstop over MAX_RENDER_STEPS."""
_REFUSED_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "format", "format_map", "join",
                              "replace", "translate"})
"""String methods whose result size the template chooses: not callable (the ``join`` and
``replace`` filters are, bounded)."""
MAX_RENDER_GROWTH = 512 << 20
"""A backstop: a render during which the process's peak memory grew by more than this stops."""
FIXED_DATE = "26 Jul 2024"
"""What ``strftime_now`` gives a template (Llama-3.1 writes today's date): fixed, so plans repeat."""
_SENTINEL = re.compile("\ue000(\\d+)\ue001")
PROBES = ([("system", ["Be brief."]), ("user", ["Hi", MediaSlot("image")]), ("assistant", ["Hello."]),
           ("user", ["Bye"]), ("assistant", ["Bye."])],
          [("user", ["Hi"]), ("assistant", ["Hello."])])
"""Conversations a template must render when it loads (the second for templates without a system role)."""


class TemplateError(ValueError):
    """A chat template that cannot be used; the message names the problem."""


class _Deadline(Exception):
    pass


def _sandbox():
    """Jinja's immutable sandbox, with every operator that builds a value checked against
    MAX_RENDER_CHARS before it runs, and the width-taking string methods and filters refused."""
    from jinja2.compiler import CodeGenerator
    from jinja2.exceptions import SecurityError
    from jinja2.filters import do_join, do_replace
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def size(value) -> int:
        return len(value) if isinstance(value, (str, bytes, list, tuple)) else 0

    def check(length: int, what: str) -> None:
        if length > MAX_RENDER_CHARS:
            raise SecurityError(f"{what} of more than {MAX_RENDER_CHARS} characters")

    class BoundedConcat(CodeGenerator):  # ``a ~ b``: through environment.bounded_concat, checked first
        def visit_Concat(self, node, frame):
            self.write("environment.bounded_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})
        code_generator_class = BoundedConcat

        def bounded_concat(self, values):
            texts = [str(v) for v in values]
            check(sum(map(len, texts)), "a '~' concatenation")
            return "".join(texts)

        def call_binop(self, context, operator, left, right):
            if operator == "*" and (size(left) or size(right)):
                count = right if size(left) else left
                if isinstance(count, int) and max(size(left), size(right)) * max(count, 0) > MAX_RENDER_CHARS:
                    raise SecurityError(f"a repetition of more than {MAX_RENDER_CHARS} characters")
            elif operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
                raise SecurityError("an exponent above 64")
            elif operator == "+" and size(left) + size(right) > MAX_RENDER_CHARS:
                raise SecurityError(f"a concatenation of more than {MAX_RENDER_CHARS} characters")
            elif operator == "%" and isinstance(left, str):
                raise SecurityError("%-formatting of strings")
            return super().call_binop(context, operator, left, right)

        def is_safe_attribute(self, obj, attr, value):
            if isinstance(obj, str) and attr in _REFUSED_METHODS:
                return False
            return super().is_safe_attribute(obj, attr, value)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, autoescape=False)

    def join(eval_ctx, value, d="", attribute=None):
        items = list(value)
        check(sum(size(str(x)) for x in items) + len(str(d)) * max(len(items) - 1, 0), "a join")
        return do_join(eval_ctx, items, d, attribute)

    def replace(eval_ctx, s, old, new, count=None):
        text, old, new = str(s), str(old), str(new)
        hits = text.count(old) if old else len(text) + 1
        check(len(text) + hits * max(len(new) - len(old), 0), "a replace")
        return do_replace(eval_ctx, text, old, new, count)

    join.jinja_pass_arg = do_join.jinja_pass_arg  # type: ignore[attr-defined]
    replace.jinja_pass_arg = do_replace.jinja_pass_arg  # type: ignore[attr-defined]
    env.filters.update(join=join, replace=replace)

    def refused(name):
        def filter_(*args, **kwargs):
            raise SecurityError(f"the {name!r} filter is not available to chat templates")
        return filter_

    for name in ("center", "indent", "wordwrap", "format", "filesizeformat", "xmlattr", "urlize"):
        env.filters[name] = refused(name)
    return env


class ChatTemplate:
    """A compiled chat template and the special tokens around it."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", specials: tuple[str, ...] = ()):
        from jinja2 import TemplateError as JinjaError

        if not isinstance(source, str) or not source.strip():
            raise TemplateError("the chat template is empty")
        if len(source) > MAX_TEMPLATE_CHARS:
            raise TemplateError(f"the chat template is {len(source)} characters, more than {MAX_TEMPLATE_CHARS}")
        env = _sandbox()

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
        steps = [0]
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

        def tracer(frame, event, arg):  # also stops a loop that writes nothing
            steps[0] += 1
            if steps[0] > MAX_RENDER_STEPS:
                raise _Deadline
            if steps[0] & 0xFFF == 0 and (time.monotonic() > deadline or
                                          resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak
                                          > MAX_RENDER_GROWTH):
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
            raise _invalid(f"the chat template took more than {MAX_RENDER_STEPS} steps (or {RENDER_TIME_S} s, or "
                           f"{MAX_RENDER_GROWTH >> 20} MiB)") from None
        except TemplateError as exc:
            raise _invalid(str(exc)) from None
        except (JinjaError, RecursionError, TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
            raise _invalid(f"the chat template failed ({type(exc).__name__}: {str(exc)[:200]})") from None
        finally:
            sys.settrace(previous)
        return "".join(out)

    def pieces(self, turns: list[tuple[str, list]]) -> list[Piece]:
        """A conversation (role, content parts: text and MediaSlot) rendered as pieces in order.
        The pieces must spell what the template writes for the real contents: where it trims
        them (Llama-3's ``| trim``) the contents are trimmed too; a template that changes them
        otherwise cannot be masked, and the sample is skipped with that reason."""
        real = self.render([{"role": role, "content": "".join(p.marker if isinstance(p, MediaSlot) else p
                                                               for p in parts)} for role, parts in turns])
        real = real[len(self.bos_token):] if self.bos_token and real.startswith(self.bos_token) else real
        for variant in (turns, [(role, _trimmed(parts)) for role, parts in turns]):
            pieces = self._pieces(variant)
            if "".join(p.marker if isinstance(p, MediaSlot) else p.text for p in pieces) == real:
                return pieces
        raise _invalid("the chat template changes the turns' text in a way the loss mask cannot follow")

    def _pieces(self, turns: list[tuple[str, list]]) -> list[Piece]:
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
                if isinstance(part, MediaSlot):
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
            match = self._special.match(text, len(text) - len(text.lstrip()))  # (Llama-2 writes ' </s>')
            if match:
                if match.start():
                    pieces.append(TextPiece("template", text[:match.start()], trainable=False, special=True))
                pieces.append(TextPiece("template", match.group(0), trainable=True, special=True))
                text = text[match.end():]
        if text:
            pieces.append(TextPiece("template", text, trainable=False, special=True))


def _trimmed(parts: list) -> list:
    """A turn's content parts with the white space around the whole content removed."""
    out = list(parts)
    if out and isinstance(out[0], str):
        out[0] = out[0].lstrip()
    if out and isinstance(out[-1], str):
        out[-1] = out[-1].rstrip()
    return out


def _invalid(reason: str) -> SampleError:
    return SampleError("", f"conversation: {reason}", kind="invalid_conversation")
