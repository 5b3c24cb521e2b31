"""Token proofs: an agent shows it holds the job's token without ever sending it.

The server's Welcome carries a random challenge, fresh for each connection. The agent's Join
carries ``proof(token, challenge, job_id, node_id)``, an HMAC-SHA256. Binding the job and the
node into the MAC means a proof cannot be moved to another job or node, and the per-connection
challenge means a recorded proof cannot be replayed on a new connection.
"""

from __future__ import annotations


def proof(token: str, challenge: str, job_id: str, node_id: str) -> str:
    # Imported here: hashlib initialises OpenSSL (~5 ms), which a run without tokens never needs.
    import hashlib
    import hmac

    msg = "\x00".join((challenge, job_id, node_id)).encode()
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def verify(token: str, challenge: str, job_id: str, node_id: str, given: str) -> bool:
    import hmac

    return hmac.compare_digest(proof(token, challenge, job_id, node_id), given)


class TokenTable:
    """Tokens from a token file: one line ``TOKEN`` for every job, or ``JOB_ID TOKEN`` per job.

    Blank lines and lines starting with ``#`` are ignored. A job's own token wins over the
    default one.
    """

    def __init__(self, default: str | None = None, per_job: dict[str, str] | None = None) -> None:
        self.default = default
        self.per_job = dict(per_job or {})

    @classmethod
    def parse(cls, text: str, *, origin: str = "token file") -> TokenTable:
        default: str | None = None
        per_job: dict[str, str] = {}
        for n, raw in enumerate(text.splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) == 1:
                if default is not None:
                    raise ValueError(f"{origin}: line {n}: a second default token")
                default = parts[0]
            elif len(parts) == 2:
                per_job[parts[0]] = parts[1]
            else:
                raise ValueError(f"{origin}: line {n}: expected TOKEN or 'JOB_ID TOKEN'")
        if default is None and not per_job:
            raise ValueError(f"{origin}: holds no token")
        return cls(default, per_job)

    def for_job(self, job_id: str) -> str | None:
        return self.per_job.get(job_id, self.default)
