"""Test support for PagedLLM, shared by `tests/` and `e2e/`: a real Kubernetes control plane
(`pagedllm_testing.cluster`, built from Kubernetes' Go modules) with a process kubelet per node,
the stand-ins for what these machines cannot run (each says so in its first line;
docs/contributing.md lists them), and the harnesses that start servers, routers and
operators."""
