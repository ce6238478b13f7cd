"""Detokenizer role: token ids from the router become text deltas for the server.

`run_detokenizer` (process.py) is the process entry the launcher spawns; `Detokenizer`
(detokenizer.py) is the pure logic, unit-tested without sockets.
"""
