"""Who may write token-stream entries, and under which keys (see ``dejavu_common.signing``).

The controller accepts a token-stream entry only when a worker that holds a stage of the current topology,
or of the one before it (its entries may still be in flight across a repair), signed it with a key that
worker registered. Each worker's key is read from its registry record (``WorkerInfo.entry_key``), one per
process instance: the keys of a worker's last few instances are kept, so entries a worker wrote just before
it restarted still verify after its new record is read.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterator, Mapping

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from dejavu_common.messages import Topology
from dejavu_common.signing import public_key
from dejavu_controller.registry import WorkerView

log = logging.getLogger("dejavu.controller.writers")

INSTANCES_KEPT = 4  # keys of a worker's most recent process instances
TOPOLOGIES_KEPT = 2  # the current topology and the one before it


class EntryWriters(Mapping[str, tuple[Ed25519PublicKey, ...]]):
    """Worker id -> the entry keys the controller accepts from it: its recent instances' keys, while it
    holds a stage (prompt or token) of one of the last ``TOPOLOGIES_KEPT`` topologies; absent otherwise."""

    def __init__(self) -> None:
        self._keys: dict[str, collections.OrderedDict[str, Ed25519PublicKey]] = {}
        self._bad: dict[str, str] = {}  # worker -> its instance whose key did not parse (logged once)
        self._holders: collections.deque[tuple[int, frozenset[str]]] = collections.deque(maxlen=TOPOLOGIES_KEPT)

    def update(self, workers: Mapping[str, WorkerView], topology: Topology | None) -> None:
        """Learn the keys of ``workers`` (the registry as last read) and the holders of ``topology``."""
        for wid, view in workers.items():
            instances = self._keys.setdefault(wid, collections.OrderedDict())
            instance = view.info.instance
            if instance in instances or self._bad.get(wid) == instance:
                continue
            try:
                instances[instance] = public_key(view.info.entry_key)
            except ValueError as exc:
                self._bad[wid] = instance
                log.warning("worker %s (instance %s) has no usable entry key: its entries are refused (%s)",
                            wid, instance, exc)  # fmt: skip
                continue
            while len(instances) > INSTANCES_KEPT:
                instances.popitem(last=False)
        if topology is not None and (not self._holders or self._holders[-1][0] != topology.epoch):
            stages = (*topology.prompt_stages, *topology.token_stages)
            self._holders.append((topology.epoch, frozenset(a.worker_id for a in stages)))

    def __getitem__(self, writer: str) -> tuple[Ed25519PublicKey, ...]:
        if not any(writer in holders for _, holders in self._holders):
            raise KeyError(writer)
        return tuple(self._keys.get(writer, {}).values())

    def __iter__(self) -> Iterator[str]:
        return iter(sorted({w for _, holders in self._holders for w in holders}))

    def __len__(self) -> int:
        return len({w for _, holders in self._holders for w in holders})
