"""The scheduler side: one per engine, in vLLM's scheduler process. It looks chunks up in the
pool, budgets loads and stores, tracks their jobs, fences copies across cache resets and
reports stats. No torch, no CUDA: it never touches KV memory."""
