"""The offline API: `LLM` (llm.py) runs the served engine loop in process; `WorkerGroup`
(workers.py) gives it TP worker processes."""
