"""The scale-out benchmark's pieces that need no server (benchmarks/scale_out.py): conversations
whose text re-encodes to the same ids within --context-len (the router sees text), the split of
cores into one taskset list per replica, and its argument checks. A whole run through the router
is in tests/scale_out/test_router.py, on the replicas that module starts anyway."""

from __future__ import annotations

import types

import pytest

from benchmarks import scale_out


def _setup(tokenizer, context_len: int) -> scale_out.TextSetup:
    args = scale_out.parse_args(["--model", "unused", "--context-len", str(context_len), "--num-intrinsics", "2"])
    return scale_out.TextSetup(args, tokenizer, types.SimpleNamespace(vocab_size=len(tokenizer)))


@pytest.mark.parametrize("context_len", [32, 200])
def test_conversation_text_round_trips_within_context_len(tokenizer, context_len):
    setup = _setup(tokenizer, context_len)
    for index in range(6):
        ids = setup.conversation("alora", index)
        # What the server encodes from the text a client sends is the prompt the benchmark measured.
        assert tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) == ids
        assert context_len // 2 < len(ids) <= context_len
        assert ids == setup.conversation("alora", index)  # the same conversation in every setup


def test_intrinsic_prompt_text_extends_the_conversation_text(tokenizer):
    # cache_aware matches the text of earlier requests: the base turn's text must be a prefix.
    setup = _setup(tokenizer, 64)
    conversation = setup.conversation("alora", 0)
    answer = tokenizer.encode(" The answer is Paris.", add_special_tokens=False)
    for k in range(2):
        text = tokenizer.decode(setup.intrinsic_prompt(conversation, answer, k))
        assert text.startswith(tokenizer.decode(conversation)) and text.endswith(setup.names[k])


def test_core_lists_split_the_allowed_cores(monkeypatch):
    monkeypatch.setattr(scale_out.os, "sched_getaffinity", lambda pid: {5, 1, 3, 7}, raising=False)
    monkeypatch.setattr(scale_out.shutil, "which", lambda name: "/usr/bin/" + name)
    assert scale_out.core_lists(4, 2) == ["1,3", "5,7"]
    assert scale_out.core_lists(2, 2) == ["1", "3"]
    assert scale_out.core_lists(2, 1) == ["1,3"]
    assert scale_out.core_lists(8, 2) is None  # fewer cores than asked: no pinning
    monkeypatch.setattr(scale_out.shutil, "which", lambda name: None)
    assert scale_out.core_lists(2, 2) is None  # no taskset


@pytest.mark.parametrize("argv, message", [
    (["--cores", "3"], "must split evenly"),
    (["--replicas", "0"], "--replicas must be >= 1"),
    (["--threads", "2"], "--cores sets each replica's threads"),
    (["--load-adapters"], "--load-adapters needs --router"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        scale_out.parse_args(["--router", "http://127.0.0.1:1"] * ("--load-adapters" not in argv) + argv)
    assert message in capsys.readouterr().err
