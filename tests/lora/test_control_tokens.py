"""The control-token routing rule (Granite Switch) as an integer scan, without a model:
adapter(p) = adapter of the last control token at or before p, 0 if none, reset -> 0;
across step boundaries, batched requests, and recomputation after preemption."""

import numpy as np

from vllm.lora.control_tokens import ControlTokenRouter, ScanState

VOCAB = 20
RESET, CTRL_A, CTRL_B = 17, 18, 19  # adapters: reset -> 0, A -> 1, B -> 2
ROUTER = ControlTokenRouter(VOCAB, {RESET: 0, CTRL_A: 1, CTRL_B: 2})


def rule(tokens):
    """The format's rule, written the slow and obvious way."""
    table = {RESET: 0, CTRL_A: 1, CTRL_B: 2}
    out, current = [], 0
    for t in tokens:
        current = table.get(t, current)
        out.append(current)
    return out


def route_in_steps(tokens, chunk):
    """Route one request whose tokens arrive `chunk` at a time, as the runner does."""
    state, out = ScanState(), []
    for start in range(0, len(tokens), chunk):
        step = np.array(tokens[start : start + chunk])
        carry = np.array([ROUTER.adapter_before(state, tokens, start)])
        out += ROUTER.route(step, np.array([0, len(step)]), carry).tolist()
    return out


def test_rule_on_one_sequence_any_chunking():
    rng = np.random.default_rng(0)
    for _ in range(50):
        tokens = rng.integers(0, VOCAB, size=int(rng.integers(1, 60))).tolist()
        for chunk in (1, 3, 16, 64):
            assert route_in_steps(tokens, chunk) == rule(tokens)


def test_control_position_is_adapted_and_switches_and_resets():
    tokens = [1, 2, CTRL_A, 3, 4, CTRL_B, 5, RESET, 6, CTRL_A]
    assert route_in_steps(tokens, 4) == [0, 0, 1, 1, 1, 2, 2, 0, 0, 1]
    assert (ControlTokenRouter.slots(np.array([0, 1, 2])) == [-1, 0, 1]).all()


def test_batched_requests_never_leak_into_each_other():
    a = [1, CTRL_B, 2, 3]
    b = [4, 5, 6]  # no control: base, though the request before it ends in adapter 2
    c = [7, 8]  # carries adapter 1 from earlier steps
    flat = np.array(a + b + c)
    cu = np.array([0, 4, 7, 9])
    out = ROUTER.route(flat, cu, np.array([0, 0, 1]))
    assert out.tolist() == [0, 2, 2, 2, 0, 0, 0, 1, 1]


def test_many_control_tokens_have_no_limit():
    tokens = [CTRL_A, CTRL_B] * 1000 + [3]
    assert route_in_steps(tokens, 512) == rule(tokens)


def test_scan_restarts_when_recomputed_from_an_earlier_position():
    tokens = [1, CTRL_A, 2, 3, RESET, 4]
    state = ScanState()
    assert ROUTER.adapter_before(state, tokens, 5) == 0  # after the reset
    assert ROUTER.adapter_before(state, tokens, 3) == 1  # preempted and recomputed from position 3
    assert ROUTER.adapter_before(state, tokens, 0) == 0
