"""How often an aLoRA intrinsic lands on the replica that holds its conversation, through a
router (docs/scale_out.md).

Each client thread runs fresh conversations: a base chat turn, then the intrinsic (the same
messages, the answer, and an empty turn whose role is the invocation, e.g. `certainty`, with
`model` = the aLoRA's name). An intrinsic whose response reports
`usage.prompt_tokens_details.cached_tokens > 0` found its conversation's KV blocks. Every
conversation's system message starts with a unique id, so no other request shares its first
KV block or (for the router) its first characters; `--shared-prefix` puts a common text before
the id, as a shared system prompt would.

    python examples/scale_out/intrinsic_affinity.py --url http://127.0.0.1:8000 \
        --model granite --adapter certainty --role certainty --threads 4 --conversations 8

With `--busy`, each intrinsic is sent while an unrelated long request keeps the conversation's
replica busier than the other, so only cache affinity (not least-load) sends it back there.
"""

from __future__ import annotations

import argparse
import random
import threading
import time

import httpx
import openai

WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega".split()


def conversation(rnd: random.Random, shared_prefix: str = "") -> list[dict]:
    system = f"{shared_prefix}{rnd.getrandbits(48):012x}: you are a helpful assistant."
    return [{"role": "system", "content": system},
            {"role": "user", "content": " ".join(rnd.choice(WORDS) for _ in range(12)) + "?"}]


def base_turn(client: openai.OpenAI, args: argparse.Namespace, messages: list[dict], max_tokens: int) -> str:
    result = client.chat.completions.create(model=args.model, messages=messages, max_tokens=max_tokens,
                                            temperature=0.0, extra_body={"ignore_eos": True})
    return result.choices[0].message.content


def intrinsic(client: openai.OpenAI, args: argparse.Namespace, messages: list[dict], answer: str) -> int:
    """The intrinsic's cached prompt tokens."""
    turns = messages + [{"role": "assistant", "content": answer}, {"role": args.role, "content": ""}]
    result = client.chat.completions.create(model=args.adapter, messages=turns, max_tokens=2, temperature=0.0)
    details = result.usage.prompt_tokens_details
    return details.cached_tokens if details and details.cached_tokens else 0


def served(replica_url: str) -> float:
    """Requests a replica finished (`vllm:request_success_total`, summed over reasons)."""
    total = 0.0
    for line in httpx.get(replica_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:request_success_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def run_thread(args: argparse.Namespace, seed: int, cached: list[int]) -> None:
    client = openai.OpenAI(base_url=args.url + "/v1", api_key=args.api_key, max_retries=0, timeout=300)
    rnd = random.Random(seed)
    for _ in range(args.conversations):
        messages = conversation(rnd, args.shared_prefix)
        answer = base_turn(client, args, messages, args.answer_tokens)
        busy = None
        if args.busy:
            # Sent right after the base turn, with both replicas idle, the router puts it where
            # the base turn went (same tie-break); it then keeps that replica the busier one.
            busy = threading.Thread(target=base_turn, args=(client, args, conversation(rnd, args.shared_prefix),
                                                             args.busy_tokens))
            busy.start()
            time.sleep(0.3)
        cached.append(intrinsic(client, args, messages, answer))
        if busy is not None:
            busy.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the router (or one server)")
    parser.add_argument("--model", required=True, help="the base model's served name")
    parser.add_argument("--adapter", required=True, help="the aLoRA's name")
    parser.add_argument("--role", required=True, help="the invocation turn's role, e.g. certainty")
    parser.add_argument("--threads", type=int, default=4, help="concurrent clients (spread load over replicas)")
    parser.add_argument("--conversations", type=int, default=8, help="conversations per thread")
    parser.add_argument("--answer-tokens", type=int, default=120, help="length of each base answer")
    parser.add_argument("--busy", action="store_true", help="keep the conversation's replica busier (one thread)")
    parser.add_argument("--busy-tokens", type=int, default=200, help="length of the request that keeps it busy")
    parser.add_argument("--shared-prefix", default="", help="text every conversation's system message starts with")
    parser.add_argument("--replicas", nargs="*", default=[], help="replica URLs: print how many requests each served")
    parser.add_argument("--api-key", default="EMPTY")
    args = parser.parse_args()
    for name in ("threads", "conversations", "answer_tokens", "busy_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.busy and args.threads != 1:
        parser.error("--busy needs --threads 1: other clients would blur which replica is busier")

    served_before = [served(url) for url in args.replicas]
    cached: list[int] = []
    threads = [threading.Thread(target=run_thread, args=(args, time.time_ns() + i, cached))
               for i in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hits = sum(c > 0 for c in cached)
    print(f"intrinsics with cached prompt tokens: {hits}/{len(cached)} ({hits / max(len(cached), 1):.0%})")
    if args.replicas:
        spread = [int(served(url) - before) for url, before in zip(args.replicas, served_before)]
        print(f"requests served per replica: {spread}")


if __name__ == "__main__":
    main()
