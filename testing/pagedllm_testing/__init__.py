"""Test support for PagedLLM, shared by `tests/` and `e2e/`: a real Kubernetes control plane
(`pagedllm_testing.cluster`, built from Kubernetes' Go modules), the Kubernetes API emulator
(`pagedllm_testing.emulator`) and the stand-ins of a cluster's controllers that the journey
still runs on, and the harnesses that start servers, routers and operators."""
