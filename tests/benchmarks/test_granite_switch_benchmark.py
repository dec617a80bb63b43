"""The Granite Switch TTFT benchmark (benchmarks/granite_switch.py): its accounting on hand-made
trials (medians, ratios of the medians, floors, the cached tokens each request should show), and
one quick run on a tiny composed checkpoint (2 layers, hidden 64, 64-token conversations, one
trial; composed in the granite-switch oracle venv) whose JSON must show the Switch aLoRA and the
PEFT aLoRA reusing every full block before the invocation and the Switch LoRA reusing nothing.
No timing assertions."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.granite_switch import KINDS, expected_cached, summarize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class FakeFloor:
    """1 ms per computed token plus 1 us per cached one."""

    def seconds(self, num_tokens, context=0):
        return num_tokens * 1e-3 + context * 1e-6


def request(prompt, cached, ttft):
    return {"prompt_token_ids": prompt, "cached": cached, "ttft": ttft}


def test_summary_takes_medians_ratios_and_floors_from_the_trials():
    prompt = list(range(40))
    ttfts = [  # base turn, Switch aLoRA, PEFT aLoRA, Switch LoRA per trial
        (1.0, 0.10, 0.08, 2.0),
        (1.2, 0.12, 0.12, 3.6),
        (1.1, 0.30, 0.10, 3.0),
    ]
    trials = [{"base_turn": request(prompt, 0, b), "switch_alora": request(prompt, 32, a),
               "peft_alora": request(prompt, 32, p), "switch_lora": request(prompt, 0, lo)}
              for b, a, p, lo in ttfts]
    s = summarize(trials, FakeFloor())
    k = s["kinds"]
    assert k["switch_alora"]["ttft_median"] == pytest.approx(0.12)
    assert k["peft_alora"]["ttft_median"] == pytest.approx(0.10)
    assert k["switch_lora"]["ttft_median"] == pytest.approx(3.0)
    assert s["switch_alora_over_peft_alora"] == pytest.approx(0.12 / 0.10)
    assert s["switch_lora_over_switch_alora"] == pytest.approx(3.0 / 0.12)
    assert s["switch_lora_over_switch_alora_per_trial"] == pytest.approx([20.0, 30.0, 10.0])
    assert k["switch_alora"]["computed_tokens"] == 8 and k["switch_lora"]["computed_tokens"] == 40
    assert k["switch_alora"]["floor_seconds"] == pytest.approx(8e-3 + 32e-6)
    assert k["switch_lora"]["x_floor"] == pytest.approx(3.0 / 40e-3)


MANIFEST = {"alora": "rw", "lora": "cit", "control_token_ids": {"rw": 900, "cit": 901},
            "alora_invocation_tokens": [1, 7, 2]}


def rendered(base):
    """(Switch aLoRA, Switch LoRA) prompts as the template places their control tokens."""
    position = len(base) - 3
    return base[:position] + [900] + base[position + 1:], [901] + base[1:]


def test_expected_cached_is_the_full_blocks_before_the_control_token():
    base = [1, 50, 2] + list(range(100, 130)) + [1, 7, 2]  # 36 tokens; the invocation starts at 33
    alora, lora = rendered(base)
    row = {"base_turn": request(base, 0, 1), "switch_alora": request(alora, 32, 1),
           "peft_alora": request(base, 32, 1), "switch_lora": request(lora, 0, 1)}
    check = expected_cached(row, MANIFEST, block_size=16)
    assert check["control_position"] == 33
    assert (check["switch_alora"], check["peft_alora"], check["switch_lora"]) == (32, 32, 0)
    assert check["problems"] == []
    row["switch_lora"] = request(base, 0, 1)  # no control token at position 0
    row["peft_alora"] = request(alora, 32, 1)  # a control token in a PEFT prompt
    assert len(expected_cached(row, MANIFEST, block_size=16)["problems"]) == 2


def test_quick_run_on_a_tiny_switch_checkpoint(tmp_path):
    out = tmp_path / "run.json"
    cmd = [sys.executable, "-m", "benchmarks.granite_switch", "--layers", "2", "--hidden", "64", "--heads", "4",
           "--kv-heads", "2", "--intermediate", "128", "--rank", "8", "--conversation-len", "64", "--turns", "1",
           "--trials", "1", "--threads", "1", "--work-dir", str(tmp_path / "work"), "--json", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert result.returncode == 0, result.stderr[-4000:]
    assert "WARNING" not in result.stdout, result.stdout
    run = json.loads(out.read_text())
    block = run["block_size"]
    (trial,), (check,) = run["trials"], run["expected"]
    assert check["problems"] == []
    assert trial["base_turn"]["prompt_tokens"] == 64  # the conversation renders to its target length
    assert trial["base_turn"]["cached"] == 0  # fresh conversation: nothing shared
    position = check["control_position"]
    assert 0 < position < 64
    assert trial["switch_alora"]["cached"] == position // block * block == check["switch_alora"]
    assert trial["peft_alora"]["cached"] == trial["switch_alora"]["cached"]
    assert trial["switch_lora"]["cached"] == 0
    kinds = run["kinds"]
    for kind in KINDS:
        assert kinds[kind]["prompt_tokens"] == 64
        assert kinds[kind]["ttft_median"] == trial[kind]["ttft"] > 0
        assert kinds[kind]["computed_tokens"] == 64 - trial[kind]["cached"]
        assert kinds[kind]["floor_seconds"] > 0
    ttft = {kind: trial[kind]["ttft"] for kind in KINDS}
    assert run["switch_alora_over_peft_alora"] == pytest.approx(ttft["switch_alora"] / ttft["peft_alora"])
    assert run["switch_lora_over_switch_alora"] == pytest.approx(ttft["switch_lora"] / ttft["switch_alora"])
    assert run["shape"]["layers"] == 2 and run["vocab_size"] < 1024
    assert "Switch aLoRA / PEFT aLoRA" in result.stdout
