"""Chat templates: Llama-3-, Qwen2- and Mistral-style templates (their public text, kept here)
render conversations as the model sees them; the mask trains exactly the assistant's content and
the end-of-turn token after it, checked token by token; the template's special tokens are single
ids while the same text in a turn is text; hostile templates are refused when the tokenizer loads."""

import json
import re

import numpy as np
import pytest

from disttrain_api.config import AudioConfig, GenerationConfig, ImageConfig
from helpers import jpeg_bytes
from preprocess_service.adapters.media import tokenizers
from preprocess_service.adapters.media.parse import parse_document

LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          "{% endif %}")
QWEN2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
         "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
         "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
           "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
STYLES = {
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>", ["<|begin_of_text|>", "<|start_header_id|>",
                                                           "<|end_header_id|>", "<|eot_id|>"]),
    "qwen2": (QWEN2, "", "<|im_end|>", ["<|im_start|>", "<|im_end|>"]),
    "mistral": (MISTRAL, "<s>", "</s>", ["[INST]", "[/INST]"]),
}
TURNS = [{"from": "human", "value": "<image>\nWhat is on the table?"}, {"from": "gpt", "value": "A red cup."},
         {"from": "human", "value": "And <|im_end|> [INST] <|eot_id|> beside it?"},
         {"from": "gpt", "value": "Nothing else."}]


def _tokenizer(tmp_path, style):
    from tokenizers import AddedToken, Tokenizer

    source, bos, eos, specials = STYLES[style]
    path = tokenizers.train_bpe(["What is on the table? A red cup. And beside it? Nothing else. system user "
                                 "assistant You are a helpful assistant."] * 20, tmp_path / "tokenizer.json", 400)
    tok = Tokenizer.from_file(str(path))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": source, "bos_token": bos,
                                                                "eos_token": {"content": eos}}))
    return tokenizers.HFTokenizer(path)


def _text(tok, ids) -> str:
    return tok._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _document(tok, turns):
    sample = {"__key__": "k", "__url__": "u", "jpg": jpeg_bytes(64, 48),
              "json": json.dumps({"conversations": turns}).encode()}
    return parse_document(sample, image_config=ImageConfig(), tokenizer=tok, seq_len=4096, audio_config=AudioConfig(),
                          generation=GenerationConfig())


@pytest.mark.parametrize("style", sorted(STYLES))
def test_a_conversation_is_rendered_by_the_tokenizers_template_and_masked_token_by_token(tmp_path, style):
    tok = _tokenizer(tmp_path, style)
    assert tok.chat_template is not None
    doc = _document(tok, TURNS)
    texts = [s for s in doc.segments if hasattr(s, "trainable")]
    ids = np.concatenate([s.ids for s in texts])
    mask = np.concatenate([np.full(len(s.ids), s.trainable) for s in texts])
    source, bos, eos, specials = STYLES[style]
    end = {"llama3": "<|eot_id|>", "qwen2": "<|im_end|>", "mistral": "</s>"}[style]
    # the trained tokens, token by token: each answer, then the end-of-turn token the template writes after it
    trained = [_text(tok, ids[i:i + 1]) if i in set(np.flatnonzero(mask)) else None for i in range(len(ids))]
    runs, current = [], []
    for piece in trained:
        if piece is None and current:
            runs.append("".join(current))
            current = []
        elif piece is not None:
            current.append(piece)
    runs.append("".join(current)) if current else None
    assert runs == [f"A red cup.{end}", f"Nothing else.{end}"], runs
    # everything else is the template's text and the user's turns, as the template renders them
    rendered = tok.chat_template.render([{"role": "user", "content": "\nWhat is on the table?"},
                                         {"role": "assistant", "content": "A red cup."},
                                         {"role": "user", "content": TURNS[2]["value"]},
                                         {"role": "assistant", "content": "Nothing else."}])
    expected = rendered[len(bos):] if bos and rendered.startswith(bos) else rendered  # the document's own BOS
    assert re.sub(r"\s", "", _text(tok, ids)) == re.sub(r"\s", "", expected)  # llama3 trims turns: blanks aside
    for special in specials:  # the template's special tokens are one id each; in a user's turn they are text
        special_id = tok._specials[special]
        assert np.count_nonzero(ids == special_id) == expected.count(special) - TURNS[2]["value"].count(special), \
            special
    assert len(doc.images) == 1  # the <image> marker placed the image inside the first user turn
    layout = [type(s).__name__ for s in doc.segments]
    assert layout.index("ImageRef") > 0, "the image sits after the template's header, not before it"


def test_a_template_that_rejects_a_conversation_skips_that_sample_only(tmp_path):
    tok = _tokenizer(tmp_path, "mistral")
    from disttrain_api.errors import SampleError

    with pytest.raises(SampleError, match="roles must alternate"):
        _document(tok, [{"from": "system", "value": "Be brief."}, *TURNS])


@pytest.mark.parametrize("hostile, why", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "took more than"),
    ("{% for i in range(100000) %}{{ 'xxxxxxxxxxxxxxxxxxxx' }}{% endfor %}", "more than 1048576 characters"),
    ("{{ messages.__class__.__mro__[1].__subclasses__() }}", "unsafe|access"),
    ("{{ cycler.__init__.__globals__.os.system('id') }}", "undefined|unsafe|access"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}{% set x = messages.append(1) %}", "unsafe|immutable|append"),
    ("{% for m in messages %", "does not compile"),
    ("{{ 'x' * 100000000000 }}", "repetition"),
    ("{% set ns = namespace(s='x' * 100000) %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "concatenation"),
    ("{% set ns = namespace(s='x' * 100000) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "concatenation"),
    ("{{ '%1000000000s' % 'x' }}", "formatting"),
    ("{{ 'x'.center(1000000000) }}", "unsafe|center"),
    ("{{ 'x'|center(1000000000) }}", "center"),
    ("{{ range(100000)|map('string')|map('replace', '', 'x' * 1000)|join }}", "replace|join|steps"),
    ("{{ (['x' * 1000000] * 100000) | join }}", "join"),
])
def test_hostile_templates_are_refused_when_the_tokenizer_loads(tmp_path, hostile, why):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": hostile}))
    tokenizers.train_bpe(["a b c"] * 5, tmp_path / "tokenizer.json", 300)
    # refused by the bound named in ``why``: a size, a refused operation, or a count of render
    # steps (not a time: a count holds on a loaded machine; the suite's per-test timeout catches a
    # render no bound stopped)
    with pytest.raises(tokenizers.TokenizerError, match=f"chat template.*({why})"):
        tokenizers.HFTokenizer(tmp_path / "tokenizer.json")


def test_without_a_template_the_fixed_headers_stay(tmp_path):
    path = tokenizers.train_bpe(["USER ASSISTANT A red cup"] * 5, tmp_path / "tokenizer.json", 300)
    tok = tokenizers.HFTokenizer(path)
    assert tok.chat_template is None
    doc = _document(tok, TURNS)
    assert "USER: " in _text(tok, np.concatenate([s.ids for s in doc.segments if hasattr(s, "trainable")]))


def test_template_files_obey_the_shard_policy_and_a_changed_template_is_seen(tmp_path):
    import os

    from disttrain_api.errors import PermissionDenied
    from preprocess_service.adapters.io.sources import ShardPolicy

    allowed, outside = tmp_path / "models", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    _tokenizer(allowed, "qwen2")
    policy = ShardPolicy(allowed_prefixes=(str(allowed),))
    first = tokenizers.load_checked(str(allowed / "tokenizer.json"), policy)
    assert first.chat_template is not None and "im_start" in first.chat_template.source
    config = json.loads((allowed / "tokenizer_config.json").read_text())
    config["chat_template"] = LLAMA3
    (allowed / "tokenizer_config.json").write_text(json.dumps(config) + " ")  # a new version: reloaded
    assert tokenizers.load_checked(str(allowed / "tokenizer.json"), policy).chat_template.source == LLAMA3
    (outside / "tokenizer_config.json").write_text(json.dumps(config))
    (allowed / "tokenizer_config.json").unlink()
    os.symlink(outside / "tokenizer_config.json", allowed / "tokenizer_config.json")  # a link out: refused
    with pytest.raises(PermissionDenied, match="outside the prefixes"):
        tokenizers.load_checked(str(allowed / "tokenizer.json"), policy)
