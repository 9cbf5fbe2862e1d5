"""Node mode: one agent per node owns the pool and hands each pod only its tenant's memory.

`identity` (who a pod is, from the kubelet), `grants` (which tenant a pod may use, from the admin's
node pool spec), `access` (whether a published pod has its tenant now, and why not), `bindings`
(socket -> pod identity and grant, kept across agent restarts), `tenant_memory`
(a sealed memfd per tenant, sent over the pod's socket), `csi` (the CSI Identity and Node services
the kubelet calls). Design and threat model: docs/NODE.md.
"""
