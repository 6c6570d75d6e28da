"""models.tokenizers: round trips, and errors that name what is wrong."""

import pytest
import torch

from models.tokenizers import CharTokenizer, TensorInput, WordTokenizer

CHARS = " .acdefghiklmnoprstuwx"


@pytest.fixture
def chars():
    return CharTokenizer("minigpt", CHARS)


@pytest.fixture
def words():
    return WordTokenizer("translator", {"P": 0, "ich": 1, "mochte": 2, "ein": 3, "bier": 4}, pad_id=0)


def test_char_ids_are_positions_in_the_vocabulary_string(chars):
    text = "attention lets tokens read context."
    assert chars.encode(text) == [CHARS.index(ch) for ch in text]
    assert chars.decode(chars.encode(text)) == text
    assert chars.tokenize(text) == list(text)
    assert chars.vocab_size == len(CHARS)
    assert chars.pad_id is None


def test_char_decode_accepts_a_tensor(chars):
    assert chars.decode(torch.tensor([2, 18, 18])) == "att"


def test_char_out_of_vocabulary_message_names_each_character_once(chars):
    with pytest.raises(ValueError) as err:
        chars.encode("atZ中 Z")
    assert str(err.value) == (
        "minigpt tokenizer: characters not in the vocabulary: 'Z', '中' "
        '(vocabulary: " .acdefghiklmnoprstuwx")'
    )


def test_char_tokenize_checks_the_vocabulary_too(chars):
    with pytest.raises(ValueError, match="'Q'"):
        chars.tokenize("Q")


def test_empty_text_is_an_error(chars, words):
    for tok in (chars, words):
        with pytest.raises(ValueError, match="empty text"):
            tok.encode("")
    with pytest.raises(ValueError, match="empty text"):
        words.encode("  \n ")  # no words at all


def test_decode_rejects_ids_outside_the_vocabulary(chars, words):
    with pytest.raises(ValueError, match="22"):
        chars.decode([0, 22])
    with pytest.raises(ValueError, match="-1"):
        words.decode([-1])


def test_words_round_trip_and_split_on_any_whitespace(words):
    assert words.encode("ich mochte  ein\tbier P") == [1, 2, 3, 4, 0]
    assert words.decode([1, 2, 3, 4, 0]) == "ich mochte ein bier P"
    assert words.tokenize("ich mochte") == ["ich", "mochte"]
    assert (words.vocab_size, words.pad_id) == (5, 0)


def test_word_out_of_vocabulary_message_names_the_words(words):
    with pytest.raises(ValueError) as err:
        words.encode("ich mochte ein Wasser Bier Wasser")
    message = str(err.value)
    assert message.startswith("translator tokenizer: words not in the vocabulary: 'Wasser', 'Bier'")
    assert "ich mochte ein bier" in message  # the vocabulary is listed


def test_tensor_input_explains_itself_on_every_call():
    tok = TensorInput("single_head", "(B, T, 32)", "use example_input()")
    for call in (tok.encode, tok.tokenize, tok.decode):
        with pytest.raises(ValueError, match=r"float tensors of shape \(B, T, 32\)"):
            call("hello")
