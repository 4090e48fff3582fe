"""What the processes of a multi-process load agree on before its collectives, and what follows.

A leaf read as a band (:mod:`otfload.place.collective_route`) ends in a collective every process must
join, in the same order. So every choice that leads to a collective is a pure function of inputs all
processes share — the plan, the mesh, the reshard policy and the kind of source — and of one
process-local fact that is *agreed* once per load: how much of this host's local files its page
cache holds (cold on any process, below ``reshard.WARM_ROUTE_FRACTION``: the load is cold
everywhere, :func:`is_cold`). Nothing a process remembers from earlier loads enters a choice; the
reshard programs are compiled ahead, while the bytes are read, so their compile is no input either.

The exchanges, their bounds and their errors are :mod:`otfload.coordination.agreement`'s
(:class:`~otfload.coordination.agreement.Agreement`); :func:`agree_load` starts one for a load whose
mesh spans processes, with the digest of its plan (:func:`plan_digest`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from otfload.coordination import current_coordinator
from otfload.coordination.agreement import DEFAULT_TIMEOUT_S, Agreed, Agreement, Facts, mesh_key
from otfload.place.collective_route import cold_processes, plan_mesh, process_devices
from otfload.plan.planner import LeafPlan


def plan_digest(leaves: Mapping[str, LeafPlan]) -> str:
    """What every process's choices read from the plan: each leaf's path, shape, dtype and sharding,
    and where its tensors lie (file, offset, shape, dtype: the reads' pages and ranges)."""
    h = hashlib.sha256()
    for path, p in leaves.items():
        spec = getattr(p.leaf.sharding, "spec", p.leaf.sharding)
        sources = [(getattr(s, "file", ""), getattr(s, "offset", 0), tuple(s.shape), str(s.dtype)) for s in p.sources]
        h.update(repr((path, tuple(p.leaf.shape), str(p.leaf.dtype), str(spec), sources)).encode())
    return h.hexdigest()[:32]


def is_cold(agreed: Agreed) -> bool:
    """Whether the disk of some process serves the load (see reshard.cold_processes)."""
    return agreed.source == "local" and bool(cold_processes(agreed.resident))


def agree_load(
    leaves: Mapping[str, LeafPlan], policy: str, local: bool, resident: float | None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> tuple[Agreement | None, Agreed]:
    """The facts a load chooses from: this process's own on a mesh of one process (no agreement),
    else exchanged with the others (:meth:`Agreement.facts`); the agreement serves the load's
    reshard exchange and collectives, each bounded by ``timeout_s`` (the load's ``collective_timeout``)."""
    source = "local" if local else "remote"
    mesh = plan_mesh(leaves)
    if mesh is None or len(process_devices(mesh)) < 2:
        return None, Agreed(policy, source, (resident,))
    agreement = Agreement(current_coordinator(), mesh_key(mesh), timeout_s)
    return agreement, agreement.facts(Facts(plan_digest(leaves), policy, source, resident))
