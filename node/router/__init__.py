"""`pagedllm router`: an OpenAI-compatible front that sends each request to the serving node
whose prefix cache already holds most of its prompt.

It subscribes to every node's ``GET /v1/kv_events`` feed (which blocks each node can reuse, and
its load), tokenizes each request as the nodes do, computes the nodes' own chained block hashes,
and picks a node by policy. Like the API server, it never loads torch.
"""
