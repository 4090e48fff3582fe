"""The HTTP library under ``huggingface_hub``'s client, whichever major version is installed.

``huggingface_hub`` 2.x builds its client (``get_session()``) on ``httpx2``, 1.x (1.31 and later)
on ``httpx``: the two libraries have the same API under different names, and the responses,
timeouts and exceptions the Hub source handles are those of the library the client uses. Which
one that is follows from the installed major version, read from ``huggingface_hub.__version__``
(not from which library imports: an environment may hold both). Type checking sees ``httpx2``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import huggingface_hub

__all__ = ["HUB_MAJOR", "httpx"]

HUB_MAJOR = int(huggingface_hub.__version__.split(".", 1)[0])
FIRST_HTTPX2_MAJOR = 2  # huggingface_hub 2.0 moved from httpx to httpx2

if TYPE_CHECKING or HUB_MAJOR >= FIRST_HTTPX2_MAJOR:
    import httpx2 as httpx
else:
    import httpx
