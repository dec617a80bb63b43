"""StructuredOutputManager: validation messages, the compile cache, bitmask contents, EOS."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from vllm.sampling_params import StructuredOutputsParams as P
from vllm.structured_output import apply_bitmask


def allowed(bitmask: torch.Tensor, row: int, vocab_size: int) -> set[int]:
    words = bitmask[row].tolist()
    return {t for t in range(vocab_size) if (words[t // 32] >> (t % 32)) & 1}


def grammar_after(manager, tokenizer, params, text):
    grammar = manager.grammar_for(params)
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert grammar.accept_token(token)
    return grammar


@pytest.mark.parametrize(
    "params, message",
    [
        (P(json={"type": "foo"}), 'Unsupported type "foo"'),
        (P(json={"type": 3}), "Type should be a string"),
        (P(json="{not json"), "not valid JSON"),
        (P(json="[1, 2]"), "must be a JSON schema object"),
        (P(json={"$ref": "#/$defs/Missing"}), "$defs"),
        (P(json={"$ref": 5}), "$ref must be a string"),
        (P(json={"$ref": "https://example.com/schema.json"}), "not local"),
        (P(json={"type": "object", "properties": []}), "properties must be an object"),
        (P(json={"type": "integer", "minimum": "zero"}), "must be a number"),
        (P(json={"enum": []}), "enum"),
        (P(regex="a(b"), "parenthesis is not closed"),
        (P(regex="(?=a)a"), "Lookahead is not supported"),
        (P(regex="[z-a]"), "lower bound is larger"),
        (P(grammar='root ::= "a" undefined'), 'Rule "undefined" is not defined'),
        (P(grammar="start: missing"), "unknown name 'missing'"),
    ],
)
def test_invalid_specs_raise_helpful_value_errors(manager, params, message):
    with pytest.raises(ValueError) as info:
        manager.validate(params)
    text = str(info.value)
    assert message in text
    assert "structured_outputs." in text  # names the field
    assert ".cc:" not in text  # no C++ source locations
    with pytest.raises(ValueError):
        manager.grammar_for(params)


def test_empty_choice_is_rejected():
    with pytest.raises(ValueError, match="choice"):
        P(choice=[])


def test_compile_once_per_spec(fresh_manager):
    manager = fresh_manager()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}}
    manager.validate(P(json=schema))
    manager.grammar_for(P(json=schema))
    manager.grammar_for(P(json=json.dumps(schema, indent=4)))  # same schema as text
    assert manager.num_compiles == 1 and manager.num_cache_hits == 2
    # Property order changes the grammar (xgrammar keeps the declared order).
    manager.validate(P(json={"type": "object", "properties": {"b": {"type": "boolean"}, "a": {"type": "integer"}}}))
    manager.validate(P(json=schema, disable_any_whitespace=True))
    assert manager.num_compiles == 3


def test_failures_are_cached(fresh_manager):
    manager = fresh_manager()
    for _ in range(3):
        with pytest.raises(ValueError, match="Unsupported type"):
            manager.validate(P(json={"type": "foo"}))
    assert manager.num_compiles == 1


def test_lru_eviction(fresh_manager):
    manager = fresh_manager(max_cached_grammars=2)
    for regex in ("a+", "b+", "c+", "a+"):
        manager.validate(P(regex=regex))
    assert manager.num_compiles == 4  # "a+" was evicted by "c+"
    manager.validate(P(regex="c+"))
    assert manager.num_compiles == 4


def test_concurrent_callers_compile_once(fresh_manager, tokenizer):
    manager = fresh_manager()
    schema = {"type": "array", "items": {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(30)}}}
    barrier = threading.Barrier(8)
    errors = []

    def worker(i):
        barrier.wait()
        try:
            if i % 2:
                manager.validate(P(json=schema))
            else:
                assert manager.grammar_for(P(json=schema)).accept_token(tokenizer.encode("[")[0])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert manager.num_compiles == 1 and manager.num_cache_hits == 7


def test_unlisted_rows_allow_everything(manager, tokenizer, vocab_size):
    bitmask = manager.allocate_bitmask(4)
    bitmask.zero_()  # stale content from an earlier step must not leak
    manager.fill_bitmask(bitmask, [(1, manager.grammar_for(P(json={"type": "boolean"})))])
    for row in (0, 2, 3):
        assert bool((bitmask[row] == -1).all())
    prefixes = {t for t in range(len(tokenizer)) if any(w.startswith(tokenizer.decode([t])) for w in ("true", "false"))}
    assert allowed(bitmask, 1, vocab_size) == prefixes


def test_padding_and_special_tokens_never_allowed(manager, tokenizer, vocab_size):
    grammar = grammar_after(manager, tokenizer, P(json={"type": "string"}), '"')
    bitmask = manager.allocate_bitmask(1)
    manager.fill_bitmask(bitmask, [(0, grammar)])
    ids = allowed(bitmask, 0, vocab_size)
    assert len(ids) > 400  # almost any text may go in a string
    assert not ids & set(range(len(tokenizer), vocab_size))  # ids past the tokenizer
    assert not ids & set(tokenizer.all_special_ids)  # <|start_of_role|> etc., EOS
    for special in tokenizer.all_special_ids:
        assert not grammar.accept_token(special)


def test_only_eos_once_complete_then_terminated(manager, tokenizer, vocab_size):
    eos = tokenizer.eos_token_id
    grammar = manager.grammar_for(P(json={"type": "boolean"}))
    assert not grammar.accept_token(eos)  # not complete yet: EOS is rejected
    assert not grammar.accept_token(tokenizer.encode("x")[0])  # rejected, state unchanged
    grammar = grammar_after(manager, tokenizer, P(json={"type": "boolean"}), "true")
    assert grammar.is_completed() and not grammar.is_terminated()
    bitmask = manager.allocate_bitmask(2)
    grammar.fill_bitmask(bitmask, 0)
    assert allowed(bitmask, 0, vocab_size) == {eos}
    assert grammar.accept_token(eos) and grammar.is_terminated()
    assert not grammar.accept_token(tokenizer.encode("true")[0])
    # A terminated grammar still listed by the scheduler: its row allows only EOS.
    manager.fill_bitmask(bitmask, [(1, grammar)])
    assert allowed(bitmask, 1, vocab_size) == {eos}
    grammar.fill_bitmask(bitmask, 0)
    assert allowed(bitmask, 0, vocab_size) == {eos}


def test_completed_grammar_may_continue_or_stop(manager, tokenizer, vocab_size):
    grammar = grammar_after(manager, tokenizer, P(regex=r"[0-9]{1,3}"), "7")
    bitmask = manager.allocate_bitmask(1)
    manager.fill_bitmask(bitmask, [(0, grammar)])
    ids = allowed(bitmask, 0, vocab_size)
    assert tokenizer.eos_token_id in ids and tokenizer.encode("4")[0] in ids


def test_explicit_stop_token_ids(fresh_manager, tokenizer, vocab_size):
    manager = fresh_manager(stop_token_ids=[tokenizer.eos_token_id, 3])
    grammar = grammar_after(manager, tokenizer, P(choice=["done"]), "done")
    bitmask = manager.allocate_bitmask(1)
    manager.fill_bitmask(bitmask, [(0, grammar)])
    assert allowed(bitmask, 0, vocab_size) == {tokenizer.eos_token_id, 3}
    assert grammar.accept_token(3) and grammar.is_terminated()
    with pytest.raises(ValueError, match="stop_token_ids"):
        fresh_manager(stop_token_ids=[vocab_size])


def test_request_fill_matches_batch_fill(manager, tokenizer):
    grammars = [
        grammar_after(manager, tokenizer, P(json={"type": "object"}), '{"a'),
        grammar_after(manager, tokenizer, P(choice=["alpha", "beta"]), "al"),
        grammar_after(manager, tokenizer, P(regex=r"\d+-\d+"), "12"),
    ]
    batch = manager.allocate_bitmask(3)
    manager.fill_bitmask(batch, list(enumerate(grammars)))
    single = manager.allocate_bitmask(3)
    for row, grammar in enumerate(grammars):
        grammar.fill_bitmask(single, row)
    assert torch.equal(batch, single)


def test_masked_sampling_follows_the_grammar(manager, tokenizer, vocab_size):
    """Greedy decoding of all-zero logits picks the lowest allowed id at every step."""
    grammar = manager.grammar_for(P(choice=["relevant", "irrelevant"]))
    bitmask = manager.allocate_bitmask(1)
    out = []
    while not grammar.is_terminated():
        manager.fill_bitmask(bitmask, [(0, grammar)])
        logits = torch.zeros(1, vocab_size)
        apply_bitmask(logits, bitmask, [0])
        token = int(logits.argmax())
        assert grammar.accept_token(token)
        out.append(token)
    assert out[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(out[:-1]) in ("relevant", "irrelevant")
