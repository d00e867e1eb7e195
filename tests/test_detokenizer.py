"""Incremental detokenization (multi-byte characters split across tokens) and stop-string hold-back."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from tests.conftest import save_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(str(path), 512)
    return AutoTokenizer.from_pretrained(str(path))


def test_multibyte_characters_are_never_split(tokenizer):
    text = "naïve café — 東京 🚀 done"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text)  # byte-level: several tokens per non-ASCII character
    detok = IncrementalDetokenizer(tokenizer, stop=[], skip_special_tokens=True)
    seen = []
    for token in ids:
        detok.add_token(token)
        seen.append(detok.visible_text(finished=False))
    assert detok.text == text
    assert all("\ufffd" not in part for part in seen)
    assert all(text.startswith(part) for part in seen)


def test_stop_string_split_across_tokens_is_held_back_and_cut(tokenizer):
    text = "abc STOP def"
    detok = IncrementalDetokenizer(tokenizer, stop=["STOP"], skip_special_tokens=True)
    streamed = []
    found = None
    for token in tokenizer.encode(text):
        found = detok.add_token(token)
        streamed.append(detok.visible_text(finished=found is not None))
        if found:
            break
    assert found == "STOP"
    assert detok.text == "abc "
    assert all("S" not in part for part in streamed)  # the stop string never leaked, even partially


def test_earliest_stop_string_wins_and_can_be_included(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=["yz", "x"], skip_special_tokens=True, include_stop_str=True)
    found = None
    for token in tokenizer.encode("wxyz"):
        found = found or detok.add_token(token)
    assert found == "x" and detok.text == "wx"
