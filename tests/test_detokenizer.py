"""Incremental detokenization: the prompt as context (SentencePiece spaces), multi-byte characters split across
tokens, stop-string hold-back, and stop strings not checked before min_tokens."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

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
    detok = IncrementalDetokenizer(tokenizer, [], stop=[], skip_special_tokens=True)
    seen = []
    for token in ids:
        detok.add_token(token)
        seen.append(detok.visible_text(finished=False))
    assert detok.text == text
    assert all("\ufffd" not in part for part in seen)
    assert all(text.startswith(part) for part in seen)


def test_stop_string_split_across_tokens_is_held_back_and_cut(tokenizer):
    text = "abc STOP def"
    detok = IncrementalDetokenizer(tokenizer, [], stop=["STOP"], skip_special_tokens=True)
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
    detok = IncrementalDetokenizer(tokenizer, [], stop=["yz", "x"], skip_special_tokens=True, include_stop_str=True)
    found = None
    for token in tokenizer.encode("wxyz"):
        found = found or detok.add_token(token)
    assert found == "x" and detok.text == "wx"


def test_stop_string_before_check_stop_is_kept_in_the_text(tokenizer):
    """vLLM's rule: stop strings are not checked before min_tokens, and the text stays a prefix of the tokens'."""
    ids = tokenizer.encode("abc STOP def STOP")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["STOP"], skip_special_tokens=True)
    late = len(tokenizer.encode("abc STOP de"))  # stop checks start at this many tokens
    found = None
    for count, token in enumerate(ids, start=1):
        found = detok.add_token(token, check_stop=count >= late)
        if found:
            break
    assert found == "STOP" and detok.text == "abc STOP def "
    assert tokenizer.decode(ids).startswith(detok.text)


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    """A Llama-2/Mistral-style tokenizer: Metaspace pre-tokenizer and decoder ("▁" marks a word's space)."""
    pieces = ["<unk>", "<s>", "</s>", "▁", "▁Hello", "▁world", "▁the", "▁capital", "▁is", "▁Paris", "."]
    pieces += list("abcdefghijklmnopqrstuvwxyzHPW")
    backend = Tokenizer(models.Unigram([(piece, -float(len(piece) < 3)) for piece in pieces], unk_id=0))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_sentencepiece_keeps_the_first_generated_space(sentencepiece_tokenizer):
    tok = sentencepiece_tokenizer
    prompt = tok.encode("Hello world", add_special_tokens=False)
    rng = np.random.default_rng(0)
    for _ in range(20):
        output = rng.integers(3, len(tok), size=int(rng.integers(1, 12))).tolist()
        detok = IncrementalDetokenizer(tok, prompt, stop=[], skip_special_tokens=True)
        for token in output:
            detok.add_token(token)
        expected = tok.decode(prompt + output)[len(tok.decode(prompt)):]
        assert detok.text == expected
    detok = IncrementalDetokenizer(tok, prompt, stop=[], skip_special_tokens=True)
    for token in tok.encode("the capital", add_special_tokens=False):
        detok.add_token(token)
    assert detok.text == " the capital"


def test_long_text_slices_and_late_stop_strings(tokenizer):
    """The text lives in pieces (so a token costs O(its piece), not O(the text)): every slice of it, a stop string
    found far into it, and the cut there are what one string would give."""
    rng = np.random.default_rng(3)
    words = ["alpha", "beta ", "gamma", " ", "δέλτα", "🚀", "END", "x"]
    text = "".join(rng.choice(words, 400)) + " fin STOPPER tail"
    detok = IncrementalDetokenizer(tokenizer, [], stop=["STOPPER", "never"], skip_special_tokens=True)
    found = None
    for token in tokenizer.encode(text):
        found = detok.add_token(token)
        if found:
            break
    expected = text[:text.index("STOPPER")]
    assert found == "STOPPER" and detok.text == expected and len(detok) == len(expected)
    detok = IncrementalDetokenizer(tokenizer, [], stop=[], skip_special_tokens=True)
    for token in tokenizer.encode(text):
        detok.add_token(token)
    assert detok.text == text
    for start, end in rng.integers(0, len(text) + 1, (200, 2)):
        assert detok.text_from(int(start), int(end)) == text[start:end]
    assert detok.visible_text(finished=False, start=len(text) - 5) == text[-5:]


def test_stop_strings_match_a_brute_force_search(tokenizer):
    """Random texts, stop strings (some of them substrings of the text, of lengths 1-9) and first checked tokens: the
    stop string found, and the cut, are a search of the whole text at each token's end would give: the earliest
    match that ends inside the first checked piece that completes one."""
    rng = np.random.default_rng(11)
    words = ["alpha", "beta ", "gamma", " ", "δέλτα", "🚀", "END", "x", "ab", "\n"]
    for trial in range(60):
        text = "".join(rng.choice(words, int(rng.integers(5, 60))))
        ids = tokenizer.encode(text)
        plain = IncrementalDetokenizer(tokenizer, [], stop=[], skip_special_tokens=True)
        ends = []  # the text's length after each token
        for token in ids:
            plain.add_token(token)
            ends.append(len(plain))
        full = plain.text
        stops = []
        for _ in range(int(rng.integers(1, 4))):
            length = int(rng.integers(1, 10))
            start = int(rng.integers(0, max(1, len(full) - length)))
            stops.append(full[start:start + length] if rng.random() < 0.7 else "zq"[:length])
        stops = [s for s in stops if s]
        late, include = int(rng.integers(1, len(ids) + 1)), bool(rng.random() < 0.5)
        expected = None
        for count in range(late, len(ids) + 1):
            before, end = (ends[count - 2] if count >= 2 else 0), ends[count - 1]
            hits = [(at, stop) for stop in stops
                    if (at := full.find(stop, max(0, before - len(stop) + 1), end)) != -1 and at + len(stop) > before]
            if end > before and hits:
                at, stop = min(hits)
                expected = (stop, full[:at + (len(stop) if include else 0)])
                break
        detok = IncrementalDetokenizer(tokenizer, [], stop=stops, skip_special_tokens=True, include_stop_str=include)
        found = None
        for count, token in enumerate(ids, start=1):
            found = detok.add_token(token, check_stop=count >= late)
            if found:
                break
        got = (found, detok.text) if found else None
        assert got == expected, (trial, text, stops, late)
        assert len(detok) == len(detok.text)
