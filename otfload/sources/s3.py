"""S3 and S3-compatible object stores (``s3://bucket/prefix`` through s3fs): checked range reads.

Every range is one ``GetObject`` with ``Range: bytes=a-b``, sent through s3fs's own client (its
credentials, endpoint, region, session and extra request arguments), so the answer's status and
headers are at hand before a byte is taken: a ``206`` must carry the ``Content-Range`` asked for, of
an object of the listed size, and exactly that many bytes; a ``200`` (an endpoint ignoring ``Range``)
is sliced when it is the whole object, as for ``gs://`` and the Hub
(:func:`~otfload.sources.range_answer.check_range_answer`). The body is copied into the caller's buffer as
it arrives; a shorter range honestly labelled is followed by a request for the rest.

Retries and time bounds are otfload's alone (:mod:`otfload.sources.retry`): the filesystem a source
opens makes one attempt per call, in s3fs's loop and in botocore's (a loop inside an attempt would
sleep away the attempt's time and hide each failure from the policy), and botocore's connect and
read timeouts are the policy's idle bound. Errors are classified from botocore's own: the HTTP
status of a ``ClientError`` (s3fs re-raises it as an ``OSError`` whose cause it is), connection and
body failures (transient), missing credentials (a permission error, before any request).
"""

from __future__ import annotations

from typing import Any

from multidict import CIMultiDict
from s3fs import S3FileSystem

from otfload.sources.fetch_threads import MAX_REQUESTS_IN_FLIGHT
from otfload.sources.range_answer import RangeSink, check_range_answer
from otfload.sources.retry import TransientError

# Body bytes taken from the client per step: large enough for GB/s, small enough to stop a long body early.
BODY_CHUNK_BYTES = 1 << 20


class SingleAttemptS3FileSystem(S3FileSystem):  # type: ignore[misc]  # s3fs is untyped
    """s3fs's filesystem making one attempt per call (its class-level ``retries``), so that the
    source's :class:`~otfload.sources.retry.RetryPolicy` alone decides; a class of its own, so that
    fsspec's instance cache never hands it to code expecting s3fs's retries."""

    retries = 1


def open_s3(url: str, **options: Any) -> tuple[SingleAttemptS3FileSystem, str]:
    """The single-attempt filesystem for ``url`` (``storage_options`` as for s3fs) and the path in it."""
    fs = SingleAttemptS3FileSystem(**options)
    root: str = fs._strip_protocol(url)
    return fs, root


def with_s3_timeouts(options: dict[str, Any], idle_s: float) -> dict[str, Any]:
    """botocore's connect/read timeouts set to ``idle_s``, its retries off and a connection for each
    of the source's requests in flight (botocore keeps 10), unless the caller's ``config_kwargs``
    choose otherwise."""
    defaults = {
        "connect_timeout": idle_s,
        "read_timeout": idle_s,
        "retries": {"total_max_attempts": 1},
        "max_pool_connections": MAX_REQUESTS_IN_FLIGHT,
    }
    options["config_kwargs"] = {**defaults, **options.get("config_kwargs", {})}
    return options


async def read_s3_range(fs: Any, path: str, what: str, offset: int, out: memoryview, size: int) -> None:
    """Fill ``out`` with the bytes of object ``path`` (``bucket/key``) at ``offset``, an object of
    ``size`` bytes, by checked ``GetObject`` range requests; ``what`` names it in errors."""
    bucket, key, version = fs.split_path(path)
    versioned = {"VersionId": version} if version else {}
    done = 0
    while done < len(out):
        start, last = offset + done, offset + len(out) - 1
        answer = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{last}", **versioned)
        body = answer["Body"]
        try:
            meta = answer["ResponseMetadata"]
            headers = CIMultiDict(meta["HTTPHeaders"])
            checked = check_range_answer(meta["HTTPStatusCode"], headers, what, start, last, size)
            sink = RangeSink(checked, out, done, f"{what} (bytes {start}-{last})")
            while chunk := await body.read(BODY_CHUNK_BYTES):
                if sink.feed(chunk):
                    break
            sink.finish()
        finally:
            body.close()
        if sink.done == done:
            raise TransientError(f"no progress at byte {start}")
        done = sink.done


def s3_status(e: BaseException) -> int | None:
    """The HTTP status of botocore's ``ClientError`` behind an S3 failure (``e`` or its cause), else None."""
    from botocore.exceptions import ClientError

    client = e if isinstance(e, ClientError) else e.__cause__
    if not isinstance(client, ClientError):
        return None
    status = client.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status if isinstance(status, int) else None


def lacks_credentials(e: BaseException) -> bool:
    """botocore found no (or half a) credential to sign with: nothing was sent."""
    from botocore.exceptions import NoCredentialsError, PartialCredentialsError

    return isinstance(e, NoCredentialsError | PartialCredentialsError)


def is_s3_transient(e: BaseException) -> bool:
    """A connection, timeout or cut-body failure of botocore: worth another attempt."""
    from botocore.exceptions import ConnectionError, HTTPClientError, IncompleteReadError

    return isinstance(e, ConnectionError | HTTPClientError | IncompleteReadError)
