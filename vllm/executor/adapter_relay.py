"""`AdapterRelay`: sends each adapter's weights to the tensor-parallel workers once while
requests use it, instead of once per request.

A request carries the host weights it was admitted with (`NewRequestData.lora_weights`, a
`LoRAModel`); pickled with every new request, a real adapter (tens of MB) would cost each
intrinsic call a copy. Rank 0 (`pack`) replaces the weights by an `AdapterRef` (their
fingerprint) when the workers already hold them; each worker (`unpack`) puts its copy back.

Invariant: both sides keep the same table `fingerprint -> ids of the requests using it`,
updated from the same scheduler outputs in the same order (this step's finished and preempted
requests leave first, then its new requests join), so a ref is only ever sent for weights the
worker holds. An entry, and the worker's copy, goes when its last request leaves; preempted
requests come back as new ones and bring the weights again if nobody kept them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vllm.core.sched_output import SchedulerOutput


@dataclass(frozen=True)
class AdapterRef:
    fingerprint: bytes


class AdapterRelay:
    def __init__(self):
        self._users: dict[bytes, set[str]] = {}
        self._weights: dict[bytes, Any] = {}  # worker side: the copies refs point to

    def pack(self, sched: SchedulerOutput) -> SchedulerOutput:
        """Rank 0: a copy of `sched` whose new requests carry refs for weights the workers hold."""
        self._leave(sched)
        new_reqs = []
        for req in sched.scheduled_new_reqs:
            weights = req.lora_weights
            if weights is not None:
                users = self._users.setdefault(weights.fingerprint, set())
                if users:
                    req = dataclasses.replace(req, lora_weights=AdapterRef(weights.fingerprint))
                users.add(req.req_id)
            new_reqs.append(req)
        return dataclasses.replace(sched, scheduled_new_reqs=new_reqs)

    def unpack(self, sched: SchedulerOutput) -> SchedulerOutput:
        """A worker: `sched` with the weights behind every ref restored (in place)."""
        self._leave(sched)
        for req in sched.scheduled_new_reqs:
            weights = req.lora_weights
            if weights is None:
                continue
            if isinstance(weights, AdapterRef):
                req.lora_weights = self._weights[weights.fingerprint]
            else:
                self._weights[weights.fingerprint] = weights
            self._users.setdefault(req.lora_weights.fingerprint, set()).add(req.req_id)
        return sched

    def _leave(self, sched: SchedulerOutput) -> None:
        gone = sched.finished_req_ids | sched.preempted_req_ids
        if not gone:
            return
        for fingerprint in list(self._users):
            users = self._users[fingerprint]
            users -= gone
            if not users:
                del self._users[fingerprint]
                self._weights.pop(fingerprint, None)

    def __len__(self) -> int:
        """Adapters the workers hold now."""
        return len(self._users)
