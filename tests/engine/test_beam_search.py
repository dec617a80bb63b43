"""`LLM.beam_search` as in vLLM: the search itself against a scripted step (stop tokens,
ignore_eos, length penalty, include_stop_str_in_output, max_model_len, ranking), then on
the tiny llama: width 1 is greedy decoding, a wider beam scores at least as well as greedy,
each beam's cum_logprob is what the model gives its tokens, and LoRA adapters apply."""

from __future__ import annotations

import math

import pytest

from vllm import LLM, SamplingParams
from vllm.beam_search import BeamSearchInstance, get_beam_search_score, run_beam_search
from vllm.lora.request import LoRARequest
from vllm.outputs import CompletionOutput, Logprob, RequestOutput
from vllm.sampling_params import BeamSearchParams

EOS = 0


def scripted_step(table):
    """A step whose next-token logprobs depend only on the last token: table[last] = {token: prob}."""
    calls = []

    def step(prompts, params, loras):
        calls.append((len(prompts), params.logprobs, loras))
        outputs = []
        for prompt in prompts:
            probs = table[prompt["prompt_token_ids"][-1]]
            top = {t: Logprob(math.log(p)) for t, p in probs.items()}
            completion = CompletionOutput(0, "", [next(iter(top))], None, [top])
            outputs.append(RequestOutput("x", None, prompt["prompt_token_ids"], None, [completion], True))
        return outputs

    return step, calls


# From 1: EOS is likely at once; 2 then leads to a confident continuation.
TABLE = {1: {EOS: 0.5, 2: 0.3, 3: 0.2}, 2: {4: 0.9, EOS: 0.1}, 3: {4: 0.5, EOS: 0.5}, 4: {4: 0.6, EOS: 0.4},
         EOS: {EOS: 0.9, 4: 0.1}}


def search(params, max_model_len=100, table=TABLE, prompt=(1,)):
    step, calls = scripted_step(table)
    out = run_beam_search(step, [BeamSearchInstance(list(prompt))], params, {EOS}, max_model_len,
                          decode=lambda ids: " ".join(map(str, ids)))
    return out[0].sequences, calls


def test_stop_token_completes_a_beam_and_results_are_ranked():
    seqs, calls = search(BeamSearchParams(beam_width=2, max_tokens=3))
    assert calls[0][:2] == (1, 4)  # one live beam, logprobs = 2 * beam_width
    assert [s.tokens for s in seqs] == [[1, 2, 4, 4], [1, EOS]]
    scores = [get_beam_search_score(s.tokens, s.cum_logprob, EOS, 1.0) for s in seqs]
    assert scores == sorted(scores, reverse=True)
    assert seqs[0].cum_logprob == pytest.approx(math.log(0.3 * 0.9 * 0.6))
    assert [s.finish_reason for s in seqs] == ["length", "stop"]
    assert seqs[1].text == "1"  # the stop token's text is left out
    assert len(seqs[0].logprobs) == 3 and len(seqs[1].logprobs) == 1


def test_include_stop_str_in_output_and_ignore_eos():
    seqs, _ = search(BeamSearchParams(beam_width=2, max_tokens=3, include_stop_str_in_output=True))
    assert seqs[1].text == f"1 {EOS}"
    seqs, _ = search(BeamSearchParams(beam_width=2, max_tokens=2, ignore_eos=True))
    assert [s.tokens for s in seqs] == [[1, EOS, EOS], [1, 2, 4]]  # EOS is an ordinary token
    assert all(s.finish_reason == "length" for s in seqs)


def test_length_penalty_changes_the_ranking():
    # Without a penalty on length (0), raw cum_logprob ranks: the short EOS beam wins.
    seqs, _ = search(BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=0.0))
    assert seqs[0].tokens == [1, EOS]


def test_max_model_len_completes_beams():
    seqs, calls = search(BeamSearchParams(beam_width=1, max_tokens=10), max_model_len=3)
    assert len(calls) == 2 and seqs[0].finish_reason == "length" and len(seqs[0].tokens) == 3


def test_beam_search_params_validation():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)


# ------------------------------------------------------------------ on the model
PROMPT = "The quick brown fox"


def greedy(llm, prompt, n, **kwargs):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
    return llm.generate([prompt], params, use_tqdm=False, **kwargs)[0].outputs[0]


def model_cum_logprob(llm, tokens, num_generated):
    """Sum of the model's logprobs of the last `num_generated` tokens, from prompt logprobs."""
    out = llm.generate([{"prompt_token_ids": tokens}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return sum(out.prompt_logprobs[i][tokens[i]].logprob for i in range(len(tokens) - num_generated, len(tokens)))


def test_width_one_is_greedy(llm):
    ref = greedy(llm, PROMPT, 8)
    out = llm.beam_search([PROMPT], BeamSearchParams(beam_width=1, max_tokens=8, ignore_eos=True))
    (seq,) = out[0].sequences
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    assert seq.tokens == prompt_ids + ref.token_ids
    assert seq.cum_logprob == pytest.approx(ref.cumulative_logprob, abs=1e-3)
    assert seq.text == llm.get_tokenizer().decode(seq.tokens)


def test_wider_beams_score_at_least_greedy_and_match_the_model(llm):
    ref = greedy(llm, PROMPT, 8)
    out = llm.beam_search([PROMPT, {"prompt": "Hello world"}], BeamSearchParams(beam_width=4, max_tokens=8,
                                                                                ignore_eos=True))
    assert len(out) == 2 and all(len(o.sequences) == 4 for o in out)
    seqs = out[0].sequences
    assert seqs[0].cum_logprob >= ref.cumulative_logprob - 1e-4
    assert [s.cum_logprob for s in seqs] == sorted((s.cum_logprob for s in seqs), reverse=True)
    for seq in seqs[:2]:
        assert model_cum_logprob(llm, seq.tokens, 8) == pytest.approx(seq.cum_logprob, abs=1e-3)


def test_width_beyond_max_logprobs_is_refused(llm):
    with pytest.raises(ValueError, match="max allowed: 20"):
        llm.beam_search([PROMPT], BeamSearchParams(beam_width=11, max_tokens=2))


def test_lora_request(llama_dir, adapters):
    llm = LLM(llama_dir, max_model_len=128, enable_lora=True, max_lora_rank=8)
    lora = LoRARequest("lora_all", 1, adapters["lora_all"])
    ref = greedy(llm, PROMPT, 6, lora_request=lora)
    base = greedy(llm, PROMPT, 6)
    out = llm.beam_search([PROMPT], BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True), lora_request=lora)
    seq = out[0].sequences[0]
    assert seq.lora_request == lora
    assert seq.cum_logprob == pytest.approx(ref.cumulative_logprob, abs=1e-3)
    assert seq.cum_logprob != pytest.approx(base.cumulative_logprob, abs=1e-3)
