"""Streamed text (`tessel.serving.text`): deltas that never split a character, stop strings
matched across tokens and left out, with a word-level and a byte-level tokenizer and no model."""

from __future__ import annotations

import random

import pytest

from tessel.serving.text import REPLACEMENT, Detokenizer, TextStream

from .words import word_tokenizer


@pytest.fixture(scope="module")
def words():
    return word_tokenizer(template=None)


@pytest.fixture(scope="module")
def byte_level():
    """One token per byte (GPT-2's byte alphabet, no merges): a character of several UTF-8
    bytes takes several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core)


def _pieces(stream: TextStream, tokens: list[int]) -> list[str]:
    pieces = [stream.push(t) for t in tokens]
    return pieces + [stream.finish()]


def test_words_after_the_prompt_keep_their_spaces(words) -> None:
    prompt = words.encode("w1 w2 w3")
    pieces = _pieces(TextStream(words, prompt), words.encode("w4 w5"))
    assert pieces == [" w4", " w5", ""]  # the text after "w1 w2 w3", as a whole decode has it
    assert _pieces(TextStream(words), words.encode("w4 w5")) == ["w4", " w5", ""]


def test_a_character_of_several_tokens_is_sent_whole(byte_level) -> None:
    text = "né€😀!"
    tokens = byte_level.encode(text)
    assert len(tokens) == 1 + 2 + 3 + 4 + 1
    pieces = _pieces(TextStream(byte_level), tokens)
    assert "".join(pieces) == text
    assert [p for p in pieces if p] == ["n", "é", "€", "😀", "!"]
    assert not any(REPLACEMENT in p for p in pieces)


def test_a_character_cut_off_at_the_end_reads_as_the_replacement(byte_level) -> None:
    tokens = byte_level.encode("a€")[:-1]
    detokenizer = Detokenizer(byte_level)
    assert [detokenizer.push(t) for t in tokens] == ["a", "", ""]
    assert detokenizer.flush() == REPLACEMENT
    assert detokenizer.flush() == ""


def test_a_stop_string_across_tokens_is_left_out(words) -> None:
    stream = TextStream(words, stop=["w3 w4"])
    pieces = _pieces(stream, words.encode("w1 w2 w3 w4 w5"))
    # "w3" is held from the moment it could begin the stop string; nothing after is sent
    assert pieces == ["w1", " w2", " ", "", "", ""]
    assert stream.stopped == "w3 w4"


def test_a_held_tail_is_sent_when_it_cannot_become_a_stop(words) -> None:
    stream = TextStream(words, stop=["w3 w9"])
    assert _pieces(stream, words.encode("w3 w4")) == ["", "w3 w4", ""]
    assert stream.stopped is None
    # and at the end, whatever is held is sent
    stream = TextStream(words, stop=["w3 w9"])
    assert _pieces(stream, words.encode("w1 w3")) == ["w1", " ", "w3"]


def test_the_earliest_stop_string_wins(words) -> None:
    stream = TextStream(words, stop=["w5", "w2 w3"])
    assert "".join(_pieces(stream, words.encode("w1 w2 w3 w4 w5"))) == "w1 "
    assert stream.stopped == "w2 w3"


def test_a_stop_string_inside_one_token(byte_level) -> None:
    stream = TextStream(byte_level, stop=["€"])
    assert "".join(_pieces(stream, byte_level.encode("ab€cd"))) == "ab"
    assert stream.stopped == "€"
    with pytest.raises(ValueError, match="at least one character"):
        TextStream(byte_level, stop=[""])


@pytest.mark.parametrize("seed", range(20))
def test_pieces_add_up_to_the_whole_decode_cut_at_the_first_stop(byte_level, seed) -> None:
    rng = random.Random(seed)
    text = "".join(rng.choice("ab €é😀\n") for _ in range(rng.randint(1, 30)))
    prompt = byte_level.encode(rng.choice(["", "x€", "hello "]))
    tokens = byte_level.encode(text)
    stops = [rng.choice(["b €", "é😀", "\n\n", "zz", "a"]) for _ in range(rng.randint(0, 2))]
    stream = TextStream(byte_level, prompt, stops)
    pieces = _pieces(stream, tokens)
    found = [text.find(s) for s in stops if s in text]
    assert "".join(pieces) == (text[: min(found)] if found else text)
    assert (stream.stopped is not None) == bool(found)
    assert not any(REPLACEMENT in p for p in pieces)
