"""The processes of one job: who this one is, a key-value store they share, and a split of work
they all compute alike without talking.

:class:`Coordinator` (publish / wait for keys; :func:`current_coordinator` picks JAX's distributed
store or a local one) is what the shard cache and the lm-eval ranks meet through, and what a
multi-process load's agreement (:mod:`otfload.place.agree`) exchanges its records over;
:func:`assign_files` says which process fetches (or writes) which file.
"""

from otfload.coordination.assign import assign_files
from otfload.coordination.coordinator import Coordinator, JaxCoordinator, LocalCoordinator, current_coordinator

__all__ = ["Coordinator", "JaxCoordinator", "LocalCoordinator", "assign_files", "current_coordinator"]
