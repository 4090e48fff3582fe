"""Byte accounting of fetches: what a read of some byte ranges fetches, predicted and counted.

One room for the rule and its numbers, used by the prediction (the plan, ``otfload inspect``, the
load report) and the execution (the readers, the remote sources) alike:

* :mod:`otfload.accounting.gaps` — which gaps between ranges a fetch reads through (smallest first, each
  below a limit, within a budget), whole pages of local files, and the tuning constants;
* :mod:`otfload.accounting.requests` — how many requests a remote read takes, and the prediction of a
  remote batch's fetch;
* :mod:`otfload.accounting.meter` — counting what a load really fetched (bytes and requests).

Sources perform fetches (:mod:`otfload.sources.runs`, :mod:`otfload.sources.fetch_threads`); this
package decides and counts them, and imports nothing else of otfload.
"""
