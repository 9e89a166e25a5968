"""Conversations in a sample's JSON (instruction data): turns with roles, only the assistant trained.

Two layouts are read:
  LLaVA   ``{"conversations": [{"from": "human" | "gpt" | "system", "value": "..."}, ...]}``
  OpenAI  ``{"messages": [{"role": "user" | "assistant" | "system", "content": "..."}, ...]}``
          (``content`` may also be a list of parts ``{"type": "text", "text": "..."}`` and
          ``{"type": "image"}``)
Either role vocabulary is accepted in either layout. With a tokenizer that ships a chat template,
the template renders it (chat_template.py). Without one, a conversation becomes text pieces in turn
order: a role header (``"USER: "``, ``"ASSISTANT: "``, ``"SYSTEM: "``, after a newline from the
second turn on) that is never trained, then the turn's content, trained only for the assistant.
An ``<image>`` marker in a turn's text (or an image part) is an image slot: parse.py puts the
sample's next image there, in member order; a ``<video>`` marker (or a video part) likewise takes
the next video. Anything else (an unknown role, a turn that is not an
object of strings, more than MAX_TURNS turns) is a SampleError of kind ``invalid_conversation``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from disttrain_api.errors import SampleError

MAX_TURNS = 1024
"""Longer conversations are refused: instruction data has a few dozen turns at most."""
IMAGE_MARKER = "<image>"
VIDEO_MARKER = "<video>"
MARKERS = {"image": IMAGE_MARKER, "video": VIDEO_MARKER}
_MARKER = re.compile("(" + "|".join(map(re.escape, MARKERS.values())) + ")")
HEADERS = {"user": "USER: ", "assistant": "ASSISTANT: ", "system": "SYSTEM: "}
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
_LAYOUTS = {"conversations": ("from", "value"), "messages": ("role", "content")}


@dataclass(frozen=True, slots=True)
class TextPiece:
    member: str
    """Pseudo member naming where it came from, e.g. ``json:conversations[1]``."""
    text: str
    trainable: bool
    special: bool = False
    """A chat template's own text: its special tokens are read as such (chat_template.py); a
    sample's text never is."""


@dataclass(frozen=True, slots=True)
class MediaSlot:
    """Where the sample's next image (or video: ``kind``) goes."""

    kind: str = "image"

    @property
    def marker(self) -> str:
        return MARKERS[self.kind]


ImageSlot = MediaSlot
"""The name of a slot before videos had them."""
IMAGE_SLOT = MediaSlot("image")
VIDEO_SLOT = MediaSlot("video")
Piece = TextPiece | MediaSlot


def parse_conversation(meta: dict, template=None) -> list[Piece] | None:
    """The conversation of a sample's JSON as pieces in order, or None when it holds none; with
    ``template`` (chat_template.ChatTemplate), rendered by it instead of the fixed headers."""
    present = [name for name in _LAYOUTS if name in meta]
    if not present:
        return None
    if len(present) > 1:
        raise _invalid(f"holds both {present[0]!r} and {present[1]!r}; give one conversation")
    name = present[0]
    turns = meta[name]
    if not isinstance(turns, list) or not turns:
        raise _invalid(f"{name!r} must be a non-empty list of turns, got {_brief(turns)}")
    if len(turns) > MAX_TURNS:
        raise _invalid(f"{name!r} has {len(turns)} turns, more than {MAX_TURNS}")
    if template is not None:
        return template.pieces([_turn(turn, name, index) for index, turn in enumerate(turns)])
    pieces: list[Piece] = []
    for index, turn in enumerate(turns):
        member = f"json:{name}[{index}]"
        role, parts = _turn(turn, name, index)
        header = ("\n" if index else "") + HEADERS[role]
        pieces.append(TextPiece(f"{member}:header", header, trainable=False))
        for part in parts:
            if isinstance(part, MediaSlot):
                pieces.append(part)
            elif part:
                pieces.append(TextPiece(member, part, trainable=role == "assistant"))
    return pieces


def _turn(turn: object, name: str, index: int) -> tuple[str, list[str | MediaSlot]]:
    """(role, content as text parts and media slots) of one turn."""
    role_key, content_key = _LAYOUTS[name]
    if not isinstance(turn, dict):
        raise _invalid(f"turn {index} of {name!r} is {_brief(turn)}, expected an object")
    role = _ROLES.get(turn.get(role_key)) if isinstance(turn.get(role_key), str) else None
    if role is None:
        raise _invalid(f"turn {index} of {name!r} has role {_brief(turn.get(role_key))}; "
                       f"expected one of {sorted(_ROLES)}")
    content = turn.get(content_key)
    if isinstance(content, str):
        return role, _split_markers(content)
    if isinstance(content, list) and name == "messages":
        return role, [p for part in content for p in _content_part(part, index)]
    raise _invalid(f"turn {index} of {name!r} has {content_key} {_brief(content)}, expected a string"
                   + (" or a list of parts" if name == "messages" else ""))


def _content_part(part: object, index: int) -> list[str | MediaSlot]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part, dict) and isinstance(part.get("text"), str):
        return _split_markers(part["text"])
    if kind == "image":
        return [IMAGE_SLOT]
    if kind == "video":
        return [VIDEO_SLOT]
    raise _invalid(f"turn {index} of 'messages' has a content part {_brief(part)}; expected "
                   '{"type": "text", "text": "..."}, {"type": "image"} or {"type": "video"}')


def _split_markers(text: str) -> list[str | MediaSlot]:
    """``"a<image>b<video>c"`` -> ``["a", IMAGE_SLOT, "b", VIDEO_SLOT, "c"]``."""
    out: list[str | MediaSlot] = []
    for i, chunk in enumerate(_MARKER.split(text)):
        out.append(MediaSlot("image" if chunk == IMAGE_MARKER else "video") if i % 2 else chunk)
    return out


def _brief(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _invalid(reason: str) -> SampleError:
    return SampleError("", f"conversation: {reason}", kind="invalid_conversation")
