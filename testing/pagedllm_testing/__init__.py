"""Test support for PagedLLM, shared by `tests/` and `e2e/`: the Kubernetes API emulator
(`pagedllm_testing.emulator`), the stand-ins of a cluster's controllers, and the harnesses that
start servers, routers and operators."""
