"""JSON over HTTP for the scorers (reward_remote.py's remote scorer and LLM judge, code_reward.py's
SandboxFusion client): one POST with retries, a deadline, a body cap and an optional bearer token, and
the URL in every error with its secrets taken out (config.redact_url).

    answer = post_json(url, {"items": [...]}, timeout_s=60, max_retries=3, key="reward_model.remote",
                       api_key_env="SCORER_TOKEN")     # Authorization: Bearer $SCORER_TOKEN

Each attempt has `timeout_s` in all, not per socket operation: a server that drips its answer one
byte at a time is cut off as one that does not answer. Connection errors, timeouts, an answer cut
short, HTTP 429 and 5xx are tried again up to `max_retries` times with exponential backoff (0.5 s,
1 s, 2 s, ...); a 4xx, an answer that is not JSON or one over MAX_BODY_BYTES fails at once. The
standard library's HTTP only.
"""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.error
import urllib.request
from typing import Any

from config import redact_url

BACKOFF_S = 0.5  # the first retry's wait; doubled for each next one
RETRY_STATUS = (429, 500, 502, 503, 504)
MAX_BODY_BYTES = 16 * 2**20  # an answer longer than this is refused, not read into memory
_CHUNK = 64 * 2**10


class HTTPFailure(Exception):
    """A request that failed for good: after the retries, or at once (not JSON, HTTP 4xx, too long)."""


def _jsonable(value: Any) -> Any:
    """json.dumps' fallback for what parquet rows hold (numpy scalars and arrays); str for the rest."""
    return value.tolist() if hasattr(value, "tolist") else str(value)


def bearer_headers(api_key_env: str | None, key: str) -> dict[str, str]:
    """{'Authorization': 'Bearer <$api_key_env>'}, or {} when api_key_env is None; HTTPFailure naming the
    variable (never its value) when it is unset or empty."""
    if api_key_env is None:
        return {}
    token = os.environ.get(api_key_env, "")
    if not token:
        raise HTTPFailure(f"{key}.api_key_env={api_key_env!r}: the environment variable is unset or empty on "
                          f"this rank (export it in the launch script, for every node)")
    return {"Authorization": f"Bearer {token}"}


def _read_body(response: http.client.HTTPResponse, deadline: float) -> bytes:
    """The answer's body, read in chunks until `deadline` (time.monotonic) or MAX_BODY_BYTES."""
    chunks, size = [], 0
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError("the answer did not arrive in time")
        chunk = response.read1(_CHUNK)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise HTTPFailure(f"answered more than {MAX_BODY_BYTES // 2**20} MiB; refused")
        chunks.append(chunk)


def post_json(url: str, body: dict[str, Any], timeout_s: float, max_retries: int, key: str,
              api_key_env: str | None = None) -> Any:
    """POST body as JSON to url and return the decoded answer (module docstring: retries, deadline, cap).
    Raises HTTPFailure naming the url (redacted), the attempts and the last status."""
    data = json.dumps(body, default=_jsonable).encode()
    headers = {"Content-Type": "application/json", **bearer_headers(api_key_env, key)}
    shown, last = redact_url(url), ""
    for attempt in range(max_retries + 1):
        if attempt:
            time.sleep(BACKOFF_S * 2 ** (attempt - 1))
        request = urllib.request.Request(url, data=data, method="POST", headers=headers)
        deadline = time.monotonic() + timeout_s
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                text = _read_body(response, deadline)
        except urllib.error.HTTPError as e:
            detail = e.read(300).decode(errors="replace")
            last = f"HTTP {e.code} {e.reason}: {detail!r}"
            if e.code not in RETRY_STATUS:  # a client error does not go away by asking again
                raise HTTPFailure(f"{shown} answered {last}") from None
            continue
        except HTTPFailure as e:
            raise HTTPFailure(f"{shown} {e}") from None
        except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out, cut short
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError) or isinstance(e, TimeoutError):
                last = f"no answer within {key}.timeout_s={timeout_s:g} s"
            else:
                last = f"{type(reason).__name__}: {reason}"
            continue
        try:
            return json.loads(text)
        except ValueError:
            raise HTTPFailure(f"{shown} answered with something that is not JSON: {text[:200]!r}") from None
    raise HTTPFailure(f"{shown} failed {max_retries + 1} times ({key}.max_retries={max_retries}); last: {last}")


def attempts_s(timeout_s: float, max_retries: int) -> float:
    """The longest a request can take with its retries and backoff, plus a margin: the guard on a call."""
    return (max_retries + 1) * timeout_s + BACKOFF_S * (2 ** max_retries - 1) + 5.0
