"""``rdzv-server``'s command line: its flags, its two subcommands' flags, and its exit codes.

Only ``argparse`` here: ``rdzv-server status`` parses with it and never imports the server.
The flags become a ``ServerConfig`` in ``config.py``; the subcommands run in ``ops_client.py``.
"""

from __future__ import annotations

import argparse

from edge.version import VersionAction

EXIT_OK = 0
EXIT_ERROR = 1  # could not serve; the endpoint is unreachable or did not answer as we expect
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3  # the server has no such job or node
DEFAULT_PORT = 29500
DEFAULT_ENDPOINT = f"127.0.0.1:{DEFAULT_PORT}"
DEFAULT_MIN_FREE_MIB = 128


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rdzv-server",
        description="Rendezvous server for node-agent jobs. With no command, it serves.",
        usage="%(prog)s [--host HOST] [--port PORT] [--log-level LEVEL]\n"
        "       %(prog)s {status,drain} [--endpoint HOST:PORT] ...",
        epilog=f"exit codes: {EXIT_OK} ok, {EXIT_ERROR} error or endpoint unreachable, "
        f"{EXIT_USAGE} usage, {EXIT_NOT_FOUND} no such job or node",
    )
    p.add_argument("--version", action=VersionAction)
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all IPv4 interfaces)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT})")
    p.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help="require tokens: a file of TOKEN or 'JOB_ID TOKEN' lines (also RDZV_TOKEN_FILE, RDZV_TOKEN)",
    )
    p.add_argument(
        "--tls-cert",
        default=None,
        metavar="FILE",
        help="speak only TLS (agents and HTTPS on the same port) with this PEM certificate chain",
    )
    p.add_argument("--tls-key", default=None, metavar="FILE", help="the certificate's unencrypted PEM key")
    p.add_argument(
        "--tls-client-ca",
        default=None,
        metavar="FILE",
        help="also require every peer (agents and HTTPS) to present a certificate signed by this CA",
    )
    p.add_argument(
        "--hello-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="close a connection that has not said hello by then (default 10)",
    )
    p.add_argument(
        "--auth-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="close a connection that said hello but has not joined its job by then (default 90)",
    )
    p.add_argument(
        "--state-dir",
        default=None,
        metavar="DIR",
        help="log every change of job state to DIR and restore it on start (default: memory only)",
    )
    p.add_argument(
        "--state-min-free-mib",
        type=int,
        default=DEFAULT_MIN_FREE_MIB,
        metavar="MIB",
        help="with --state-dir: below this much free space on its disk, refuse new nodes (running jobs "
        f"are still served) until space is freed (default {DEFAULT_MIN_FREE_MIB})",
    )
    p.add_argument(
        "--read-token-file",
        default=None,
        metavar="PATH",
        help="with tokens: a file holding a token that may read every job's detail over HTTP "
        "(and nothing else); a job's own token reads that job",
    )
    p.add_argument(
        "--http-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a name this server is reached by over HTTP (repeatable); requests whose Host header names "
        "anything else but an IP, localhost or this machine's name are refused (DNS rebinding)",
    )
    p.add_argument(
        "--metrics-jobs",
        type=int,
        default=0,
        metavar="N",
        help="give /metrics per-job training gauges (step, steps/s, last-progress age, stragglers, hang) "
        "labelled with the job's id, for the N largest running jobs (most nodes, then the oldest; never "
        "chosen by id, which agents pick) (default 0: none; /metrics answers any Host, so a job id there "
        "is readable by whoever reaches the port)",
    )
    p.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log verbosity"
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def client(name: str, help: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=help)
        c.add_argument(
            "--endpoint",
            default=DEFAULT_ENDPOINT,
            help=f"the server's host:port (default {DEFAULT_ENDPOINT})",
        )
        c.add_argument(
            "--timeout", type=float, default=5.0, help="seconds to wait for the server (default 5)"
        )
        # Own dests: the server's --tls-cert (above) is a different certificate.
        c.add_argument(
            "--tls-ca",
            dest="client_tls_ca",
            metavar="FILE",
            help="use HTTPS and verify the server against this CA (also RDZV_TLS_CA)",
        )
        c.add_argument(
            "--tls-cert",
            dest="client_tls_cert",
            metavar="FILE",
            help="client certificate, for a server with --tls-client-ca (also RDZV_TLS_CERT)",
        )
        c.add_argument("--tls-key", dest="client_tls_key", metavar="FILE", help="its key (also RDZV_TLS_KEY)")
        return c

    st = client("status", "show a running server's jobs, or one job in detail")
    st.add_argument("--job", help="show this job: its members, failures and recent history")
    st.add_argument("--json", action="store_true", help="print the API's JSON instead of tables")
    st.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help="for a server with tokens: the job's token, to see its detail "
        "(also RDZV_TOKEN_FILE, RDZV_TOKEN)",
    )
    st.add_argument(
        "--read-token-file",
        default=None,
        metavar="PATH",
        help="the server's read token, which shows every job's detail (also RDZV_READ_TOKEN)",
    )
    dr = client("drain", "ask a node to leave its job cleanly (its workers get SIGTERM first)")
    dr.add_argument("--job", required=True, help="the job's rdzv id")
    dr.add_argument("--node", required=True, help="the node's id")
    dr.add_argument("--reason", default="", help="why; shown to the agent and kept in the job's history")
    dr.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help="the job's token, for a server that requires one (also RDZV_TOKEN_FILE, RDZV_TOKEN)",
    )
    return p
