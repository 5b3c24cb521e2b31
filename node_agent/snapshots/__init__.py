"""In-memory snapshots (issue 35), the agent's side: what this node holds (``holdings``) and the
authenticated agent-to-agent channel that replicates and fetches them (``channel``)."""
