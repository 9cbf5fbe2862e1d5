"""`kvoffload demo`: a sidecar, a CPU vLLM engine with the connector and a multi-turn chat, run
on one machine. Nothing in the product imports it."""
