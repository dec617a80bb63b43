"""Sampling parameters: seeds, n, stop strings and tokens, min_tokens, penalties,
logprobs and prompt logprobs, detokenisation."""

import torch

from tests.utils.checkpoints import load_hf_model
from tests.utils.reference import hf_prompt_logprobs
from vllm import SamplingParams

PROMPT = "What is the capital of France?"


def _gen(llm, params, prompts=(PROMPT,)):
    return llm.generate(list(prompts), params, use_tqdm=False)


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=12, ignore_eos=True)
    a = _gen(llm, params)[0].outputs[0].token_ids
    # A different batch composition must not change a seeded request's tokens.
    b = _gen(llm, params, [PROMPT, "other prompt", "a third one"])[0].outputs[0].token_ids
    c = _gen(llm, SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=8, max_tokens=12, ignore_eos=True))
    assert a == b
    assert c[0].outputs[0].token_ids != a


def test_n_samples(llm):
    out = _gen(llm, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)


def test_stop_token_and_stop_string(llm):
    base = _gen(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    stop_id = base.token_ids[4]
    out = _gen(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id]))[0].outputs[0]
    first = base.token_ids.index(stop_id)
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id

    text = base.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    out = _gen(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.text == text[: text.index(stop)] and out.stop_reason == stop and out.finish_reason == "stop"
    out = _gen(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=stop,
                                   include_stop_str_in_output=True))[0].outputs[0]
    assert out.text == text[: text.index(stop) + len(stop)]
    assert "".join(out.token_texts) == out.text


def test_eos_and_min_tokens(llm):
    eos = llm.get_tokenizer().eos_token_id
    # Bias EOS up so it wins at once; min_tokens holds it back.
    bias = {eos: 100.0}
    out = _gen(llm, SamplingParams(temperature=0, max_tokens=10, logit_bias=bias))[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    out = _gen(llm, SamplingParams(temperature=0, max_tokens=10, logit_bias=bias, min_tokens=4))[0].outputs[0]
    assert len(out.token_ids) == 5 and out.token_ids[-1] == eos and eos not in out.token_ids[:4]


def test_allowed_token_ids_and_penalties(llm):
    out = _gen(llm, SamplingParams(temperature=1.0, seed=0, max_tokens=10, allowed_token_ids=[5, 6]))[0].outputs[0]
    assert set(out.token_ids) <= {5, 6}
    plain = _gen(llm, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0].token_ids
    penalised = _gen(llm, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                         frequency_penalty=2.0, presence_penalty=2.0))[0].outputs[0].token_ids
    assert len(set(penalised)) >= len(set(plain))
    assert penalised != plain or len(set(plain)) == len(plain)


def test_prompt_logprobs_match_transformers(llm, llama_dir):
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPT * 3)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    ref = hf_prompt_logprobs(load_hf_model(llama_dir), ids)
    ours = [out.prompt_logprobs[i + 1][ids[i + 1]].logprob for i in range(len(ids) - 1)]
    assert max(abs(a - b) for a, b in zip(ours, ref)) < 1e-4
    assert all(len(d) >= 3 for d in out.prompt_logprobs[1:])


def test_logprobs_top_n_ranks(llm):
    out = _gen(llm, SamplingParams(temperature=0, max_tokens=4, logprobs=5))[0].outputs[0]
    for token_id, lp in zip(out.token_ids, out.logprobs):
        assert lp[token_id].rank == 1  # greedy picks the most likely token
        values = [v.logprob for k, v in lp.items()]
        assert len(lp) == 5 and max(values) == lp[token_id].logprob
    assert abs(out.cumulative_logprob - sum(lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs))) < 1e-5


def test_multibyte_detokenization(llm):
    tok = llm.get_tokenizer()
    text = "日本語のテキスト ✓ 🙂 café"
    ids = tok.encode(text)
    # Force the model to emit exactly these tokens, one per step.
    outputs = []
    prompt = tok.encode("x")
    for i in range(len(ids)):
        params = SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=[ids[i]])
        out = llm.generate([{"prompt_token_ids": prompt + ids[:i]}], params, use_tqdm=False)[0]
        outputs.append(out.outputs[0].token_ids[0])
    assert outputs == ids
    # Now the incremental detokenizer over the whole sequence.
    from vllm.engine.detokenizer import IncrementalDetokenizer
    from vllm.tokenizer import id_decoder

    detok = IncrementalDetokenizer(id_decoder(tok), prompt, SamplingParams())
    for i, token_id in enumerate(ids):
        detok.update([token_id], finished=i == len(ids) - 1)
    assert detok.text == text
    assert "".join(detok.token_texts) == text
    assert all("\ufffd" not in piece for piece in detok.token_texts)


def test_greedy_ignores_sampling_knobs(llm):
    a = _gen(llm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
    b = _gen(llm, SamplingParams(temperature=0, top_p=0.1, top_k=3, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
    assert a == b
    assert torch.is_grad_enabled()  # the engine does not leak inference mode


def test_streamed_deltas_keep_token_texts_aligned_with_stop_strings(llm):
    """DELTA outputs hold back text a stop string could still cut, and the tokens whose
    text is held back, so every delta's token texts concatenate to its text."""
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    base = _gen(llm, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    # A stop string that spans a token boundary.
    cut = len(base.token_texts[0]) + len(base.token_texts[1])
    stop = base.text[cut - 1 : cut + 1]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop], logprobs=0,
                            output_kind=RequestOutputKind.DELTA)
    engine.add_request("delta-stop", PROMPT, params)
    text, texts, ids = "", [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            completion = out.outputs[0]
            assert "".join(completion.token_texts) == completion.text
            assert len(completion.token_texts) == len(completion.token_ids) == len(completion.logprobs)
            text += completion.text
            texts += completion.token_texts
            ids += completion.token_ids
    assert text == base.text[: base.text.index(stop)] and "".join(texts) == text


def test_chat_continue_final_message_with_a_custom_role(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "hi"}, {"role": "certainty", "content": ""}]
    out = llm.chat(messages, SamplingParams(max_tokens=1), add_generation_prompt=False,
                   continue_final_message=True, use_tqdm=False)[0]
    assert tok.decode(out.prompt_token_ids, skip_special_tokens=False).endswith("<|start_of_role|>certainty<|end_of_role|>")
