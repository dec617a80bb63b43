"""vllm.tokenizer.id_decoder: the same text as the tokenizer's own decode, whichever path it takes."""

import random

import pytest
from transformers import PreTrainedTokenizerFast

from tests.utils.tokenizer import SPECIAL_TOKENS, build_tokenizer
from vllm.tokenizer import id_decoder

TEXTS = ["Hello world, café naïve 日本語 🙂", "  two  spaces ,  and a comma .", "don 't stop ! ? x"]


def _id_lists(tok) -> list[list[int]]:
    rng = random.Random(0)
    lists = [tok.encode(t) for t in TEXTS]
    special = tok.convert_tokens_to_ids(SPECIAL_TOKENS)
    lists.append(lists[0][:3] + special + lists[1])  # special tokens among text
    lists += [[rng.randrange(len(tok)) for _ in range(rng.randrange(1, 12))] for _ in range(200)]  # any ids,
    lists += [[i] for i in range(len(tok))]  # and every token alone (split multi-byte characters too)
    return lists


def _assert_same_text(tok, decode) -> None:
    for ids in _id_lists(tok):
        for skip in (True, False):
            for spaces in (True, False):
                assert decode(ids, skip, spaces) == tok.decode(ids, skip_special_tokens=skip,
                                                               spaces_between_special_tokens=spaces), (ids, skip)


def test_fast_tokenizer_without_cleanup_decodes_in_rust():
    tok = build_tokenizer()
    assert not tok.clean_up_tokenization_spaces
    decode = id_decoder(tok)
    _assert_same_text(tok, decode)


def test_fast_tokenizer_with_cleanup_keeps_transformers_cleanup():
    base = build_tokenizer()
    tok = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, eos_token=SPECIAL_TOKENS[0],
                                  additional_special_tokens=SPECIAL_TOKENS[1:], clean_up_tokenization_spaces=True)
    _assert_same_text(tok, id_decoder(tok))


@pytest.mark.parametrize("method", ["decode", "_decode"])
def test_a_tokenizer_that_overrides_decoding_keeps_its_decode(method):
    class Shouting(PreTrainedTokenizerFast):
        pass

    original = getattr(PreTrainedTokenizerFast, method)
    setattr(Shouting, method, lambda self, *args, **kwargs: original(self, *args, **kwargs).upper())
    tok = Shouting(tokenizer_object=build_tokenizer().backend_tokenizer, eos_token=SPECIAL_TOKENS[0])
    decode = id_decoder(tok)
    ids = tok.encode("hello world")
    assert decode(ids, True, True) == "HELLO WORLD"
    _assert_same_text(tok, decode)
