"""In-memory snapshots (issue 35), the agent's side: what this node holds (``holdings``) and the
authenticated agent-to-agent channel that replicates and fetches them: its wire (``wire``, pure),
the replica server (``server``), and the peers' side, push, pull and the background replication
(``client``). ``node`` is the agent's part that holds them together."""
