"""A stand-in for the kubelet (test infrastructure; the real kubelet needs a container runtime,
which these machines do not have): one process per Node, which it registers (capacity,
allocatable, addresses, Ready, nodeInfo) and keeps alive through its Lease, running the pods
the real scheduler binds to it as local processes, each pod in a network namespace of its own
with an address on the cluster's bridge, and reporting their status. It authenticates as
`system:node:NAME`, so the Node authorizer and NodeRestriction admit only what they admit for a
real kubelet; pods get their service-account token through the TokenRequest API, mounted where
in-cluster clients read it.

Not emulated: images (the host's files are the image), users and security contexts, resource
limits (the pods share the machine), exec probes, volumes other than emptyDir, configMap,
secret, downwardAPI and projected, token rotation (tokens last the test), kube-proxy (nothing
dials a ClusterIP), Events of the kubelet's own. GPU nodes have no GPU: their pods run on the
CPU."""
