"""Incremental text for streams (core/detokenize.py): the pieces add up to the whole text's
decode, a character split across tokens is held until whole, a decoder that drops a leading
space at the start of a decode gets its context, and only a possible start of a stop string
is held back."""

import random

import pytest

from specdecode.core.detokenize import Holdback, IncrementalText

# byte pieces: "é" (c3 a9) and "日" (e6 97 a5) split across tokens, as byte-level BPE splits them
BYTES = [b"a", b" b", b"\xc3", b"\xa9", b"\xe6", b"\x97", b"\xa5", b" cd", b"!", b" "]


def byte_decode(ids: list[int]) -> str:
    return b"".join(BYTES[i] for i in ids).decode("utf-8", errors="replace")


def sentencepiece_decode(ids: list[int]) -> str:
    """Words with a leading space, the first one's dropped, as SentencePiece decodes."""
    return "".join(f" w{i}" for i in ids).removeprefix(" ")


@pytest.mark.parametrize("decode", [byte_decode, sentencepiece_decode], ids=["bytes", "sentencepiece"])
@pytest.mark.parametrize("seed", range(20))
def test_the_pieces_add_up_to_the_whole_decode_however_the_tokens_arrive(decode, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(len(BYTES)) for _ in range(60)]
    text, pieces, end = IncrementalText(decode), [], 0
    while end < len(ids):
        end += rng.randint(1, 5)
        pieces.append(text.extend(ids[:end]))
    whole, joined = decode(ids), "".join(pieces)
    assert whole.startswith(joined)
    if not whole.endswith("\ufffd"):  # else the last window waits for the rest of its character
        assert joined == whole


def test_a_character_split_across_tokens_is_held_until_whole():
    text = IncrementalText(byte_decode)
    assert text.extend([0]) == "a"
    assert text.extend([0, 4]) == ""  # the first byte of three
    assert text.extend([0, 4, 5]) == ""
    assert text.extend([0, 4, 5, 6]) == "日"
    assert text.extend([0, 4, 5, 6, 7]) == " cd"


def test_a_decoder_that_drops_the_first_space_gets_it_back_from_the_context():
    text = IncrementalText(sentencepiece_decode)
    assert text.extend([1]) == "w1"
    assert text.extend([1, 2, 3]) == " w2 w3"
    assert text.extend([1, 2, 3, 4]) == " w4"


def test_only_an_ending_that_may_begin_a_stop_string_is_held():
    holdback = Holdback(["STOP", "xy"])
    assert holdback.release("abc S") == "abc "
    assert holdback.release("T") == ""  # "ST" may still become "STOP"
    assert holdback.release("AY") == "STAY"
    assert holdback.release(" x") == " "
    assert holdback.release("z") == "xz"
    assert Holdback([]).release("STO") == "STO"
