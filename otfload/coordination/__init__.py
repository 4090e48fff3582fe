"""The processes of one job: who this one is, a key-value store they share, and a split of work
they all compute alike without talking.

:class:`Coordinator` (publish / wait for keys; :func:`current_coordinator` picks JAX's distributed
store or a local one) is what the shard cache and the lm-eval ranks meet through, and what a
multi-process load's agreement exchanges its records over (:mod:`otfload.coordination.agreement`:
the exchanges before its collectives, their bounds and errors; what a load agrees on is
:mod:`otfload.place.agree`'s);
:func:`assign_files` says which process fetches (or writes) which file.
"""

from otfload.coordination.assign import assign_files
from otfload.coordination.coordinator import Coordinator, JaxCoordinator, LocalCoordinator, current_coordinator

__all__ = ["Coordinator", "JaxCoordinator", "LocalCoordinator", "assign_files", "current_coordinator"]
