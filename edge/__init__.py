"""What both programs load at their edge, before any machine runs.

``protocol/`` is pure (bytes in, messages out) and the two programs' machines take their
settings as values. Reading files and the environment, and starting the event loop, happen
here, once, for ``rdzv-server`` and ``node-agent`` alike:

- ``tokens.py``: tokens from ``--token-file`` / ``RDZV_TOKEN_FILE`` / ``RDZV_TOKEN`` and the
  read token's file, into ``protocol.auth.TokenTable``;
- ``tls.py``: PEM files into ``ssl.SSLContext`` for the server's port and for its clients,
  and the clients' ``RDZV_TLS_*`` variables; every bad file named in a ``TLSConfigError``;
- ``loop.py``: ``run_loop``, uvloop where it is installed;
- ``atomic_write.py``: ``replace_file``, a whole file or none, written beside it under an
  unpredictable name and never through a planted link (the agent's error file and reports).

Each module is imported only by the program that needs it, when it needs it: an agent
without TLS never imports ``ssl``, and one without tokens never initialises ``hashlib``.
"""
