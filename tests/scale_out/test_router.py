"""Two `vllm serve` replicas of the tiny llama behind `vllm-router` 0.1.17 (docs/scale_out.md).

What is checked:
- every request is answered through the router: model listing, chat and completions, both
  streamed, health, and the load the `power_of_two` policy polls (`/get_load` on each replica);
- an adapter loaded at run time on every replica (examples/scale_out/load_adapter.py, on the
  replicas the router lists) is served through the router, and unloaded from every replica;
- the scale-out benchmark (benchmarks/scale_out.py --router) on these replicas: its text prompts
  let cache_aware send every intrinsic home, and every request it sent is answered;
- cache affinity of aLoRA intrinsics: a conversation's base turn, then the intrinsic (the same
  messages plus the answer and the invocation turn, `model` = the aLoRA) from several client
  threads at once. With `cache_aware` and the documented `--cache-threshold`, >= 95% of the
  intrinsics report cached prompt tokens, also when the conversation's replica is the busier
  one; round robin is printed for contrast and must do worse;
- a replica killed mid-run leaves the rotation: only requests in flight on it may fail, and
  everything sent a moment later is answered by the survivor.

A hit is `cached_tokens > 0`, which means the conversation's own blocks: every conversation
starts with a unique system prompt, so its first KV block differs from every other request's.
Both replicas must have served conversations during the cache_aware run, or affinity would be
trivial.
"""

from __future__ import annotations

import random
import threading
import time

import httpx
import openai
import pytest

from examples.scale_out.load_adapter import load_on_every_replica, router_replicas
from tests.scale_out.utils import RouterProcess, requests_served, router_missing_reason, start_replicas

pytestmark = pytest.mark.skipif(router_missing_reason() is not None, reason=str(router_missing_reason()))

MODEL = "tiny-llama"
ADAPTER = "alora_certainty"
INVOCATION_ROLE = "certainty"  # the chat template renders <|start_of_role|>certainty<|end_of_role|>
# The setting docs/scale_out.md recommends for intrinsics whose conversation ends in a long answer.
AFFINITY_ARGS = ("--cache-threshold", "0.05")
# Base answers ~2.5x longer than the conversation's text: their intrinsics fall below the router's
# default threshold (0.3), where least-load routing sends some of them away (docs/scale_out.md).
ANSWER_TOKENS = 120
NO_EOS = {"ignore_eos": True}  # the random tiny model may sample EOS at once
WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega".split()


@pytest.fixture(scope="module")
def replicas(llama_dir, adapters, tmp_path_factory):
    args = ["--served-model-name", MODEL, "--max-model-len", "512", "--enable-lora", "--enable-activated-lora",
            "--max-lora-rank", "8", "--lora-modules", f"{ADAPTER}={adapters[ADAPTER]}",
            "--allowed-lora-root", str(tmp_path_factory.getbasetemp())]
    servers = start_replicas(llama_dir, args, 2, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    yield servers
    for server in servers:
        server.close()


def _client(router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="EMPTY", max_retries=0, timeout=120)


def _conversation(rnd: random.Random) -> list[dict]:
    # Unique from the first character: no shared KV block, and no text prefix the router could
    # match across conversations (a shared one above the threshold would glue them to one replica).
    return [{"role": "system", "content": f"{rnd.getrandbits(48):012x}: you are a helpful assistant."},
            {"role": "user", "content": " ".join(rnd.choice(WORDS) for _ in range(12)) + "?"}]


def _intrinsic(conversation: list[dict], answer: str) -> list[dict]:
    return conversation + [{"role": "assistant", "content": answer}, {"role": INVOCATION_ROLE, "content": ""}]


def _base_turn(client: openai.OpenAI, conversation: list[dict], answer_tokens: int) -> str:
    result = client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=answer_tokens,
                                            temperature=0.0, extra_body=NO_EOS)
    return result.choices[0].message.content


def _intrinsic_cached_tokens(client: openai.OpenAI, conversation: list[dict], answer: str) -> int:
    result = client.chat.completions.create(model=ADAPTER, messages=_intrinsic(conversation, answer), max_tokens=2,
                                            temperature=0.0)
    return result.usage.prompt_tokens_details.cached_tokens


def _concurrent_hits(router: RouterProcess, threads: int, per_thread: int, answer_tokens: int) -> list[int]:
    """Each thread: base turn, then the intrinsic, for `per_thread` fresh conversations.
    Returns every intrinsic's cached_tokens."""
    cached: list[int] = []
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        client, rnd = _client(router), random.Random(seed)
        try:
            for _ in range(per_thread):
                conversation = _conversation(rnd)
                answer = _base_turn(client, conversation, answer_tokens)
                cached.append(_intrinsic_cached_tokens(client, conversation, answer))
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    workers = [threading.Thread(target=run, args=(time.time_ns() + i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return cached


def _busy_replica_hits(router: RouterProcess, conversations: int, answer_tokens: int) -> int:
    """Base turn, then a long unrelated request that the router sends where the base turn went
    (both replicas idle: the same tie-break), then the intrinsic while that replica is the busier
    one, so least-load routing would pick the other. Returns how many intrinsics hit."""
    client, rnd, hits = _client(router), random.Random(time.time_ns()), 0
    for _ in range(conversations):
        conversation = _conversation(rnd)
        answer = _base_turn(client, conversation, answer_tokens)
        busy = threading.Thread(target=_base_turn, args=(_client(router), _conversation(rnd), 200))
        busy.start()
        time.sleep(0.3)
        hits += _intrinsic_cached_tokens(client, conversation, answer) > 0
        busy.join()
    return hits


def test_every_request_answered_through_router(replicas):
    with RouterProcess([r.url for r in replicas], "cache_aware", AFFINITY_ARGS) as router:
        client = _client(router)
        assert {MODEL, ADAPTER} <= {m.id for m in client.models.list().data}
        assert httpx.get(router.url + "/health").status_code == 200

        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4, extra_body=NO_EOS)
        assert chat.choices[0].message.content and chat.usage.prompt_tokens > 0
        text = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, extra_body=NO_EOS)
        assert text.choices[0].text and text.usage.completion_tokens == 4

        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                                max_tokens=5, stream=True, stream_options={"include_usage": True},
                                                extra_body=NO_EOS)
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert [c for c in chunks if c.choices and c.choices[0].finish_reason == "length"]
        assert chunks[-1].usage.completion_tokens == 5
        pieces = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt="Twice", max_tokens=5,
                                                                        stream=True, extra_body=NO_EOS)]
        assert "".join(pieces)

        # power_of_two reads each replica's /get_load; the router reports -1 for a replica it cannot read.
        load = httpx.get(replicas[0].url + "/get_load").json()
        assert load["load"] == load["num_reqs"] + load["num_waiting_reqs"] and load["num_tokens"] >= 0
        loads = httpx.get(router.url + "/get_loads").json()["workers"]
        assert len(loads) == 2 and all(entry["load"] >= 0 for entry in loads), loads


def test_runtime_adapter_loaded_on_every_replica(replicas, adapters):
    # The router forwards /v1/load_lora_adapter to one replica only: examples/scale_out/load_adapter.py
    # posts it to each replica the router lists.
    with pytest.raises(ValueError, match="no replica URLs"):
        load_on_every_replica([], "certainty_rt", adapters[ADAPTER])
    with RouterProcess([r.url for r in replicas], "round_robin") as router:
        listed = router_replicas(router.url)
        assert sorted(listed) == sorted(r.url for r in replicas)
        assert load_on_every_replica(listed, "certainty_rt", adapters[ADAPTER]) == {url: "" for url in listed}
        try:
            served_before = [requests_served(r) for r in replicas]
            client, rnd = _client(router), random.Random(3)
            for _ in range(4):
                result = client.chat.completions.create(model="certainty_rt",
                                                        messages=_intrinsic(_conversation(rnd), "Paris."),
                                                        max_tokens=2)
                assert result.choices[0].message.content is not None
            assert all(requests_served(r) - before >= 2 for r, before in zip(replicas, served_before))
        finally:
            unloaded = load_on_every_replica(listed, "certainty_rt", unload=True)
        assert unloaded == {url: "" for url in listed}
        assert "certainty_rt" not in {m.id for m in client.models.list().data}


def test_scale_out_benchmark_on_running_router(replicas, llama_dir, tmp_path_factory):
    # benchmarks/scale_out.py --router: text prompts through cache_aware, the adapters loaded on
    # every replica and unloaded after; every intrinsic found its conversation's blocks.
    from benchmarks import scale_out

    adapter_dir = tmp_path_factory.mktemp("scale_out_adapters")  # under the replicas' --allowed-lora-root
    conversations, intrinsics = 4, 1
    with RouterProcess([r.url for r in replicas], "cache_aware", AFFINITY_ARGS) as router:
        results = scale_out.main(["--model", llama_dir, "--router", router.url, "--load-adapters",
                                  "--adapter-dir", str(adapter_dir), "--context-len", "96", "--answer-len", "8",
                                  "--num-intrinsics", str(intrinsics), "--intrinsic-len", "2", "--rank", "8",
                                  "--num-conversations", str(conversations), "--concurrency", "2",
                                  "--json", str(adapter_dir / "run.json")])
        served = _client(router).models.list().data
    run = results["router"]
    # The pipelines, and the router-side warm-up conversation, each a base turn and its intrinsics.
    assert sum(run["served_per_replica"]) == (conversations + 1) * (1 + intrinsics)
    intrinsic = [c for c in run["calls"] if c["step"] >= 1]
    assert len(intrinsic) == conversations * intrinsics and all(c["output_tokens"] == 2 for c in intrinsic)
    assert run["summary"]["intrinsic_calls_cached"] == 1.0
    # The text sent re-encodes within --context-len (random ids can split a character).
    assert all(c["prompt_tokens"] <= 96 for c in run["calls"] if c["step"] == 0)
    assert not {m.id for m in served} & {"alora-certainty", "lora-certainty"}


def test_intrinsics_follow_their_conversation(replicas):
    served_before = [requests_served(r) for r in replicas]
    with RouterProcess([r.url for r in replicas], "cache_aware", AFFINITY_ARGS) as router:
        cache_aware = _concurrent_hits(router, threads=4, per_thread=4, answer_tokens=ANSWER_TOKENS)
        spread = [requests_served(r) - before for r, before in zip(replicas, served_before)]
        busy_hits = _busy_replica_hits(router, conversations=2, answer_tokens=ANSWER_TOKENS)
    with RouterProcess([r.url for r in replicas], "round_robin") as router:
        round_robin = _concurrent_hits(router, threads=4, per_thread=4, answer_tokens=ANSWER_TOKENS)

    def share(cached: list[int]) -> float:
        return sum(c > 0 for c in cached) / len(cached)

    print(f"\nintrinsics with cached prompt tokens: cache_aware {share(cache_aware):.0%} of {len(cache_aware)} "
          f"(requests per replica {spread}), busy-replica case {busy_hits}/2; "
          f"round_robin {share(round_robin):.0%} of {len(round_robin)}")
    assert min(spread) >= 4, f"both replicas must serve conversations, or affinity is trivial: {spread}"
    assert share(cache_aware) >= 0.95
    assert busy_hits == 2
    assert share(round_robin) < share(cache_aware)


def test_killed_replica_leaves_rotation(replicas):
    survivor, victim = replicas
    outcomes: list[tuple[float, float, bool]] = []  # (sent, answered, ok)
    stop = threading.Event()

    with RouterProcess([r.url for r in replicas], "round_robin") as router:
        def run() -> None:
            client = _client(router)
            while not stop.is_set():
                sent = time.time()
                try:
                    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=8, extra_body=NO_EOS)
                    outcomes.append((sent, time.time(), True))
                except openai.APIError:
                    outcomes.append((sent, time.time(), False))

        workers = [threading.Thread(target=run) for _ in range(3)]
        for w in workers:
            w.start()
        time.sleep(2.0)
        assert requests_served(victim) > 0, "the victim must have been in the rotation"
        killed_at = time.time()
        victim.proc.kill()
        victim.proc.wait()
        served_at_kill = requests_served(survivor)
        time.sleep(4.0)
        stop.set()
        for w in workers:
            w.join()
        healthy = router.workers()

    failed_at = [sent for sent, _, ok in outcomes if not ok]
    after = [ok for sent, _, ok in outcomes if sent > killed_at + 2.0]
    print(f"\n{len(outcomes)} requests, {len(failed_at)} failed; {len(after)} sent 2 s after the kill")
    assert len(failed_at) <= 3, "only requests in flight on the killed replica may fail"
    assert all(sent <= killed_at + 2.0 for sent in failed_at)
    assert after and all(after)
    assert healthy == {survivor.url: True, victim.url: False}
    assert requests_served(survivor) - served_at_kill >= len(after)
