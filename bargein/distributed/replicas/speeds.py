"""Each whole-model replica's speed, measured once its replicas have started, for the router.

A replica's speed is its node's calibration (:func:`~bargein.distributed.calibrate.measure_nodes`:
the model's layer matrices timed there with the replica's threads, cached on the node) and
the router weighs each replica by it (:meth:`~bargein.distributed.router.Router.set_speeds`),
so a slow machine gets fewer new conversations. Replicas at one address share its CPUs:
there is nothing to compare, and none is measured (every weight stays 1). A node that does
not answer in time leaves every weight at 1, as does a replica that did not report where it
runs. A replica that Ray restarts on another node keeps the weight it started with.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from bargein.distributed.calibrate import LayerShapes, measure_nodes
from bargein.distributed.replicas.cluster import node_addresses

if TYPE_CHECKING:
    from bargein.distributed.replicas.facade import ReplicaSet

log = logging.getLogger("bargein.distributed")


def weigh_by_speed(replica_set: ReplicaSet) -> list[float | None]:
    """Measures each replica's node (one per address, one after another) and hands the
    rates to the router; returns them (None: not measured)."""
    infos = replica_set.replica_infos()
    addresses = node_addresses()
    where = {i: addresses.get(info.node_id) for i, info in infos.items()}
    count = len(replica_set.actors)
    if len(infos) < count or None in where.values() or len(set(where.values())) < 2:
        return [None] * count
    one_per_address = {address: infos[i].node_id for i, address in where.items()}
    threads = {infos[i].node_id: infos[i].threads for i in where}
    speeds = measure_nodes({node: address for address, node in one_per_address.items()}, threads,
                           LayerShapes.of(replica_set.facts.model_config))
    rates = [speeds[one_per_address[where[i]]].layers_per_s if one_per_address[where[i]] in speeds else None
             for i in range(count)]
    replica_set.router.set_speeds(rates)
    log.info("replica speeds (layers/s, routing weight): %s", ", ".join(
        f"{i} on {where[i]} {r['layers_per_s']} x{r['speed']}" for i, r in enumerate(replica_set.router.snapshot())))
    return rates
