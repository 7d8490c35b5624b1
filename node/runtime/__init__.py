"""What the node's and the router's processes share, below both ``api`` and ``serve``: the
Prometheus metrics (``metrics``), the OTLP request traces (``tracing``), what a child process
does first (``child_process``), the watched adapter list (``adapter_file``) and the values of
the flags both command lines take (``flags``)."""
