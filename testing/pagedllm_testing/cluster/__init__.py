"""A real Kubernetes cluster on one machine for the tests, `make cluster` and the tour: the
control plane built from Kubernetes' own Go modules (control_plane, binary, pki)."""
