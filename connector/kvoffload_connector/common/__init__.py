"""What both sides of the connector use: the pool client and its sessions, the config, the pool
keys, the metadata the scheduler hands to its workers, vLLM compatibility, the engine key and the
node memory client. Imports neither side."""
