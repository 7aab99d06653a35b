"""botocore's errors in ckptstore's terms: which S3 answers mean what, and the error to raise.

Missing bucket or object -> NotFoundError; 403 and bad or missing credentials -> StorageError
(permanent); 5xx, throttling and network failures that outlived botocore's retries ->
StorageError marked transient. The backend asks these predicates which answers to retry.
"""

from __future__ import annotations

from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    IncompleteReadError,
    NoCredentialsError,
    ReadTimeoutError,
    ResponseStreamingError,
)

from .. import remote_knobs
from ..errors import CkptStoreError, NotFoundError, StorageError, clip, redact

ACCESS_CODES = {
    "AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch",
    "ExpiredToken", "InvalidToken", "TokenRefreshRequired", "AccountProblem",
}  # fmt: skip
NETWORK_ERRORS = (EndpointConnectionError, ConnectionClosedError, ConnectTimeoutError, ReadTimeoutError)
# Failures while reading a response body happen after botocore's retry loop has returned.
STREAM_ERRORS = (ResponseStreamingError, IncompleteReadError, ReadTimeoutError, ConnectionClosedError)


def error_code(exc: ClientError) -> tuple[str, int | None]:
    """``(S3 error code, HTTP status)`` of a ClientError."""
    error = exc.response.get("Error", {})
    return str(error.get("Code", "")), exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")


def is_precondition_failed(exc: ClientError) -> bool:
    """A create-only write found the object already there (412)."""
    code, status = error_code(exc)
    return status == 412 or code == "PreconditionFailed"


def is_conflict(exc: Exception) -> bool:
    """A create-only write raced another (409), which botocore does not retry and we do."""
    # 412 wins: a write that found the key already there is finished, so never retried.
    if not isinstance(exc, ClientError) or is_precondition_failed(exc):
        return False
    code, status = error_code(exc)
    return status == 409 or code == "ConditionalRequestConflict"


def is_missing(exc: Exception) -> bool:
    """The object (not the bucket) does not exist."""
    if not isinstance(exc, ClientError):
        return False
    code, status = error_code(exc)
    return code in ("NoSuchKey", "404", "NotFound") or (status == 404 and code != "NoSuchBucket")


def translate(
    exc: Exception, *, action: str, name: str, uri: str, bucket: str, endpoint: str
) -> CkptStoreError:
    """The ckptstore error for ``exc``, raised while trying to ``action`` object ``name`` of
    the store at ``uri`` (``name`` "" for the store itself). Its message never holds the
    userinfo (``user:password@``) of an endpoint URL, and stays a few hundred characters."""
    error = _translate(exc, action=action, name=name, uri=uri, bucket=bucket, endpoint=redact(endpoint))
    error.args = (clip(redact(str(error)), 400),)
    return error


def _translate(
    exc: Exception, *, action: str, name: str, uri: str, bucket: str, endpoint: str
) -> CkptStoreError:
    where = f"{uri}/{name}" if name else uri
    if isinstance(exc, ClientError):
        code, status = error_code(exc)
        message = exc.response.get("Error", {}).get("Message") or code
        if code == "NoSuchBucket":
            return NotFoundError(f"bucket {bucket} does not exist at {endpoint}")
        if is_missing(exc):
            return NotFoundError(f"object {name} is missing from {uri}")
        if status == 403 or code in ACCESS_CODES:
            return StorageError(
                f"cannot {action} {where}: access denied ({code}: {message}); "
                "check the AWS credentials and the bucket policy"
            )
        if status is not None and (status >= 500 or status == 429 or code in ("SlowDown", "Throttling")):
            return StorageError(
                f"cannot {action} {where}: {code} ({message}), still failing after "
                f"{remote_knobs.s3_max_attempts()} attempts",
                transient=True,
            )
        return StorageError(f"cannot {action} {where}: {code} ({message})")
    if isinstance(exc, NoCredentialsError):
        return StorageError(
            f"cannot {action} {where}: no AWS credentials found (environment, ~/.aws, or an instance role)"
        )
    if isinstance(exc, NETWORK_ERRORS + STREAM_ERRORS):
        return StorageError(
            f"cannot {action} {where}: {endpoint} unreachable after "
            f"{remote_knobs.s3_max_attempts()} attempts ({exc})",
            transient=True,
        )
    return StorageError(f"cannot {action} {where}: {exc}")
