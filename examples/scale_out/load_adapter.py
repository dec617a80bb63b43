"""Load (or unload) a LoRA / aLoRA adapter at run time on every replica behind vllm-router
(docs/scale_out.md, "Adapters on every replica").

vllm-router forwards `POST /v1/load_lora_adapter` to one replica only, so an adapter loaded
through it is served by that replica alone. This posts the call to each replica's own URL: the
replicas the router lists at `GET /workers` (`--router`), or the URLs given (`--replicas`).

    python examples/scale_out/load_adapter.py --router http://127.0.0.1:8000 \
        --name certainty --path /adapters/certainty
    python examples/scale_out/load_adapter.py --replicas http://host1:8000 http://host2:8000 \
        --name certainty --unload

Each replica needs `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` (and `--allowed-lora-root` covering
the path), and the path must exist on every replica's host. Exits non-zero when any replica
refused; a replica that restarts later needs the call again (or `--lora-modules` at its start).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

import httpx


def router_replicas(router_url: str, api_key: Optional[str] = None, timeout: float = 10.0) -> list[str]:
    """The replica URLs the router knows (its `GET /workers`), healthy or not."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(router_url.rstrip("/") + "/workers", headers=headers, timeout=timeout)
    response.raise_for_status()
    return [worker["url"] for worker in response.json()["workers"]]


def load_on_every_replica(replicas: list[str], name: str, path: Optional[str] = None, unload: bool = False,
                          api_key: Optional[str] = None, timeout: float = 120.0) -> dict[str, str]:
    """Post the load (with `path`) or unload of adapter `name` to each replica. Returns replica
    URL -> "" when it answered 200, else its status and body; every replica is tried even after
    one refused, so the caller sees the whole picture."""
    if not replicas:
        raise ValueError("no replica URLs: give at least one (or a router that lists its workers)")
    if unload == (path is not None):
        raise ValueError("give an adapter path to load, or unload=True without a path")
    route, body = ("/v1/unload_lora_adapter", {"lora_name": name}) if unload else \
        ("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    failures = {}
    for replica in replicas:
        try:
            response = httpx.post(replica.rstrip("/") + route, json=body, headers=headers, timeout=timeout)
            failures[replica] = "" if response.status_code == 200 else f"{response.status_code} {response.text}"
        except httpx.HTTPError as e:  # a replica that is down must not hide the others' answers
            failures[replica] = f"unreachable: {e}"
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--router", help="the router's URL: load on every replica it lists at GET /workers")
    where.add_argument("--replicas", nargs="+", help="the replicas' own URLs")
    parser.add_argument("--name", required=True, help="the adapter's served name (lora_name)")
    parser.add_argument("--path", help="the adapter's folder on the replicas' hosts (to load)")
    parser.add_argument("--unload", action="store_true", help="unload the adapter instead")
    parser.add_argument("--api-key", default=None, help="the replicas' --api-key, if they have one")
    args = parser.parse_args()
    if args.unload == (args.path is not None):
        parser.error("give --path to load, or --unload without --path")
    replicas = args.replicas or router_replicas(args.router, args.api_key)
    results = load_on_every_replica(replicas, args.name, args.path, args.unload, args.api_key)
    for replica, failure in results.items():
        print(f"{replica}: {failure or 'ok'}")
    sys.exit(1 if any(results.values()) else 0)


if __name__ == "__main__":
    main()
