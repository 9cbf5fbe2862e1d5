"""The worker side: one per GPU worker rank. It maps the pool file, holds the engine lock, runs
the copies between vLLM's KV cache and pool slots (transfer/) and checks slot versions before
a load's bytes count. Never imports the scheduler side."""
