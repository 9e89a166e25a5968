"""Tokenizers users bring: a Hugging Face ``tokenizers`` file (tokenizer.json) or a sentencepiece
model, behind the packer's ``Tokenizer`` protocol (core/tokenizer.py).

Special tokens. BOS and EOS are the tokenizer's own when it has them (``<s>``/``</s>``,
``<|begin_of_text|>``/``<|end_of_text|>``, ``<|endoftext|>``, ...), else added. The modality
placeholders (``<|image|>``, ``<|audio|>``, ``<|gen_image|>``) and a padding token are taken from
the tokenizer's special tokens when it has them and added otherwise:

* Hugging Face: only a special added token is taken; otherwise a special token is added (under a
  fresh name if its name is an ordinary token of the vocabulary, which text could produce), so
  none ever comes out of ``encode`` for ordinary text; the reported ``vocab_size`` counts them;
* sentencepiece: a model cannot grow after training, so the placeholders and a missing pad get
  the ids right after its pieces (``vocab_size`` counts them too), even when the model holds a
  piece of that name (a ``user_defined_symbols`` piece is produced from text).

The text of a special token inside data (a caption holding ``<|image|>`` or ``</s>``) is encoded
as ordinary text, never as the special id: data cannot forge document boundaries or media slots.

``encode_batch`` encodes many texts in one call (the Rust tokenizer runs them on its thread pool;
sentencepiece encodes a list in C++), which is what the service uses per shard window.

Loading is bounded: a file larger than ``MAX_TOKENIZER_BYTES`` or one the library cannot read is a
``TokenizerError`` naming the path and the problem, never a crash of the service.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

MAX_TOKENIZER_BYTES = 64 << 20
"""Largest tokenizer file the service loads (Llama-3's tokenizer.json is ~9 MB, Gemma's ~34 MB)."""
PLACEHOLDERS = {"image_id": "<|image|>", "audio_id": "<|audio|>", "gen_id": "<|gen_image|>"}
PAD = "<|pad|>"
BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>", "[BOS]", "<|startoftext|>")
EOS_CANDIDATES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "[EOS]", "<|im_end|>")
ADDED_BOS, ADDED_EOS = "<|bos|>", "<|eos|>"


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used; the message names the file and the problem."""


def _read_file(path: Path) -> bytes:
    """The file's bytes: a regular file only (a FIFO fails at once, never blocks), at most
    MAX_TOKENIZER_BYTES read whatever its size claims."""
    from preprocess_service.adapters.io.remote import ShardReadError
    from preprocess_service.adapters.io.schemes.local import open_regular

    try:
        with open_regular(str(path)) as f:
            data = f.read(MAX_TOKENIZER_BYTES + 1)
    except (ShardReadError, OSError) as exc:
        raise TokenizerError(f"tokenizer {path}: cannot read it ({exc})") from None
    if len(data) > MAX_TOKENIZER_BYTES:
        raise TokenizerError(f"tokenizer {path}: more than the {MAX_TOKENIZER_BYTES} bytes allowed")
    return data


def _chat_template(path: Path, specials: tuple[str, ...]):
    """The chat template beside a tokenizer.json: ``chat_template.jinja``, else
    ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named ones: "default"),
    with its ``bos_token`` and ``eos_token``; None when there is none. A template that cannot be
    used is a TokenizerError naming the file."""
    import json

    from preprocess_service.adapters.media.chat_template import ChatTemplate, TemplateError

    config_path, jinja_path = path.parent / "tokenizer_config.json", path.parent / "chat_template.jinja"
    config: dict = {}
    if config_path.is_file():
        try:
            loaded = json.loads(_read_file(config_path))
            config = loaded if isinstance(loaded, dict) else {}
        except ValueError as exc:
            raise TokenizerError(f"tokenizer {config_path}: not JSON ({exc})") from None
    source = _read_file(jinja_path).decode("utf-8", "replace") if jinja_path.is_file() else config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is None:
        return None

    def token(name: str) -> str:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        return value if isinstance(value, str) else ""

    try:
        return ChatTemplate(source, bos_token=token("bos_token"), eos_token=token("eos_token"), specials=specials)
    except TemplateError as exc:
        raise TokenizerError(f"tokenizer {path.parent}: its chat template cannot be used: {exc}") from None


def template_digest(tokenizer) -> str:
    """A digest of the tokenizer's chat template ("" without one): plans depend on it."""
    import hashlib

    template = getattr(tokenizer, "chat_template", None)
    return "" if template is None else hashlib.sha256(template.source.encode()).hexdigest()


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer.json (BPE, WordPiece, Unigram; what Llama, Qwen,
    Mistral and GPT-2 ship)."""

    kind = "hf"

    def __init__(self, path: str | Path):
        from tokenizers import AddedToken, Tokenizer

        self.path = Path(path)
        data = _read_file(self.path)
        try:
            self._tok = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as exc:  # the Rust library raises plain Exceptions for every kind of bad file
            raise TokenizerError(f"tokenizer {self.path}: not a tokenizers file ({str(exc)[:200]})") from None
        self._tok.no_padding()
        self._tok.no_truncation()
        self.added: list[str] = []

        def ensure(*names: str) -> int:
            special = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
            for name in names:
                if name in special:
                    return special[name]
            fresh, n = names[-1], 0
            vocab = self._tok.get_vocab(with_added_tokens=True)
            while fresh in vocab:  # an ordinary token (text can produce it): use another name
                n += 1
                fresh = f"{names[-1][:-2]}#{n}|>"
            self._tok.add_special_tokens([AddedToken(fresh, special=True, normalized=False)])
            self.added.append(fresh)
            return self._tok.token_to_id(fresh)

        self.bos_id = ensure(*BOS_CANDIDATES, ADDED_BOS)
        self.eos_id = ensure(*EOS_CANDIDATES, ADDED_EOS)
        self.pad_id = ensure("<pad>", "[PAD]", PAD)
        self.image_id = ensure(PLACEHOLDERS["image_id"])
        self.audio_id = ensure(PLACEHOLDERS["audio_id"])
        self.gen_id = ensure(PLACEHOLDERS["gen_id"])
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # special tokens' text in a caption is encoded as text: data cannot forge a BOS or an image slot
        self._tok.encode_special_tokens = True
        self._specials = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self.chat_template = _chat_template(self.path, tuple(self._specials))
        """The tokenizer's own chat template (chat_template.py), or None: conversations then get
        fixed USER:/ASSISTANT: headers."""

    def encode_template(self, text: str) -> np.ndarray:
        """A chat template's own text: its special tokens (``<|im_start|>`` ...) as their ids,
        the rest encoded as text."""
        ids: list[int] = []
        at = 0
        pattern = self.chat_template._special if self.chat_template is not None else None
        for match in pattern.finditer(text) if pattern is not None else ():
            if match.start() > at:
                ids += self._tok.encode(text[at:match.start()], add_special_tokens=False).ids
            ids.append(self._specials[match.group(0)])
            at = match.end()
        if at < len(text):
            ids += self._tok.encode(text[at:], add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int32)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


class SentencePieceTokenizer:
    """A sentencepiece model (``.model``; what Llama-2, Gemma and T5 ship)."""

    kind = "sentencepiece"

    def __init__(self, path: str | Path):
        import sentencepiece

        self.path = Path(path)
        data = _read_file(self.path)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_proto=data)
        except Exception as exc:  # RuntimeError/OSError from the C++ side, by version
            raise TokenizerError(f"tokenizer {self.path}: not a sentencepiece model ({exc})") from None
        pieces = self._sp.get_piece_size()
        self.added = []
        next_id = pieces

        def own(special_id: int, name: str) -> int:
            """The model's own control id (text never produces one), else a new id after the pieces:
            never a piece of that name, which text can produce (user_defined_symbols)."""
            nonlocal next_id
            if special_id >= 0 and self._sp.is_control(special_id):
                return special_id
            self.added.append(name)
            next_id += 1
            return next_id - 1

        self.bos_id = own(self._sp.bos_id(), ADDED_BOS)
        self.eos_id = own(self._sp.eos_id(), ADDED_EOS)
        self.pad_id = own(self._sp.pad_id(), PAD)
        self.image_id = own(-1, PLACEHOLDERS["image_id"])
        self.audio_id = own(-1, PLACEHOLDERS["audio_id"])
        self.gen_id = own(-1, PLACEHOLDERS["gen_id"])
        self.vocab_size = next_id
        self._pieces = pieces

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.encode(text), dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int32) for ids in self._sp.encode(texts)]

    def decode(self, ids) -> str:
        special = {self.bos_id, self.eos_id, self.pad_id, self.image_id, self.audio_id, self.gen_id}
        return self._sp.decode([int(i) for i in ids if int(i) < self._pieces and int(i) not in special])


def train_bpe(texts, path: str | Path, vocab_size: int = 8000) -> Path:
    """A byte-level BPE tokenizer.json trained on ``texts`` (with ``<s>``/``</s>``): for tests,
    benchmarks and users without a tokenizer of their own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return Path(path)


def train_sentencepiece(texts, path: str | Path, vocab_size: int = 8000) -> Path:
    """A unigram sentencepiece model with byte fallback trained on ``texts`` (as ``train_bpe``); fewer
    pieces than ``vocab_size`` where the texts hold fewer."""
    import io

    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size,
                                             model_type="unigram", byte_fallback=True, hard_vocab_limit=False,
                                             minloglevel=2)
    Path(path).write_bytes(model.getvalue())
    return Path(path)


def split_spec(spec: str) -> tuple[str, str]:
    """(kind, path) of a tokenizer spec: ("byte", ""), ("hf", PATH) or ("sentencepiece", PATH)."""
    if spec in ("", "byte"):
        return "byte", ""
    kind, sep, path = spec.partition(":")
    if sep and kind in ("hf", "sentencepiece"):
        return kind, path
    if spec.endswith(".json"):
        return "hf", spec
    if spec.endswith(".model"):
        return "sentencepiece", spec
    return "folder", spec  # a model folder, as Hugging Face models ship: resolved by _in_folder


FOLDER_FILES = (("tokenizer.json", "hf"), ("tokenizer.model", "sentencepiece"))
"""What a model folder given as the tokenizer is searched for, in this order."""


def _in_folder(spec: str, path: str) -> tuple[str, str]:
    """(kind, file) of the tokenizer in a model folder."""
    if os.path.isdir(path):
        for name, kind in FOLDER_FILES:
            if os.path.isfile(os.path.join(path, name)):
                return kind, os.path.join(path, name)
    raise TokenizerError(f"tokenizer {spec!r:.200}: expected 'byte', hf:PATH (tokenizer.json) or sentencepiece:PATH "
                         "(.model), a path ending in .json or .model, or a model folder holding tokenizer.json or "
                         "tokenizer.model")


def load_tokenizer(spec: str):
    """``byte`` (the default), ``hf:PATH`` / a ``.json`` path, or ``sentencepiece:PATH`` / a
    ``.model`` path; a TokenizerError names what is wrong. No path checks: see ``load_checked``."""
    from preprocess_service.core.tokenizer import ByteTokenizer

    kind, path = split_spec(spec)
    if kind == "byte":
        return ByteTokenizer()
    if kind == "folder":
        kind, path = _in_folder(spec, path)
    return _cached(kind, path, *_version(path), _siblings(kind, path))


def load_checked(spec: str, policy):
    """The tokenizer of a job's spec, its path checked like a local shard first (sources.parse and
    sources.check under the operator's ``policy``: realpath, no '..', allowed schemes and prefixes;
    local files only). Loaded files are cached per (path, mtime, size): jobs share them."""
    from preprocess_service.adapters.io import sources

    kind, path = split_spec(spec)
    if kind == "byte":
        return load_tokenizer("byte")
    source = sources.parse(path, spec)
    if not source.is_local:
        raise TokenizerError(f"tokenizer {spec!r:.200}: only a file on the service's machine can be a tokenizer")
    sources.check(source, policy, spec)
    path = source.location
    if kind == "folder":  # the file inside is checked too: a symlink in the folder may point anywhere
        kind, path = _in_folder(spec, path)
        inner = sources.parse(path, spec)
        sources.check(inner, policy, spec)
        path = inner.location
    if kind == "hf":  # the chat template's files beside it are read too: checked the same way
        for name in TEMPLATE_FILES:
            sibling = os.path.join(os.path.dirname(path), name)
            if os.path.lexists(sibling):
                sources.check(sources.parse(sibling, spec), policy, spec)
    return _cached(kind, path, *_version(path), _siblings(kind, path))


def _version(path: str) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError as exc:
        raise TokenizerError(f"tokenizer {path}: cannot read it ({exc.strerror})") from None
    return st.st_mtime_ns, st.st_size


TEMPLATE_FILES = ("tokenizer_config.json", "chat_template.jinja")
"""Files beside a tokenizer.json that may hold its chat template."""


def _siblings(kind: str, path: str) -> tuple:
    """The versions of the chat template's files beside ``path``: a changed template is a new
    tokenizer (and a new fingerprint)."""
    if kind != "hf":
        return ()
    out = []
    for name in TEMPLATE_FILES:
        try:
            st = os.stat(os.path.join(os.path.dirname(path), name))
            out.append((name, st.st_mtime_ns, st.st_size))
        except OSError:
            continue
    return tuple(out)


@functools.lru_cache(maxsize=8)
def _cached(kind: str, path: str, mtime_ns: int, size: int, siblings: tuple = ()):
    """One loaded tokenizer per file version; ``mtime_ns``, ``size`` and the template files'
    versions (``siblings``) only key the cache."""
    return HFTokenizer(path) if kind == "hf" else SentencePieceTokenizer(path)


def describe(tokenizer) -> dict:
    """The ids and vocabulary size a trainer needs (JobInfo.tokenizer), plus the file's SHA-256."""
    path = getattr(tokenizer, "path", None)
    digest = ""
    if path is not None:
        digest = _sha256(str(path), *_version(str(path)))
    return {"kind": getattr(tokenizer, "kind", "byte"), "vocab_size": tokenizer.vocab_size,
            "pad_id": tokenizer.pad_id, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id,
            "image_id": tokenizer.image_id, "audio_id": tokenizer.audio_id, "gen_id": tokenizer.gen_id,
            "sha256": digest, "added_tokens": list(getattr(tokenizer, "added", []))}


@functools.lru_cache(maxsize=8)
def _sha256(path: str, mtime_ns: int, size: int) -> str:
    import hashlib

    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
