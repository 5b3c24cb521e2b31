"""The rendezvous machine: the server's rules, pure (no I/O, no clock, no randomness of its
own). Events in, effects out; ``state.Rendezvous`` is the entry point. The asyncio layer
(``rdzv_server.service``), the state log's replay (``rdzv_server.journal``) and the etcd
backend's replicas feed it. ``tests/test_pure.py`` holds every module here to that."""
