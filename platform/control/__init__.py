"""The control plane's decisions, free of HTTP and torch: the gateway's invocation queue
and admission (and, as they land, the cluster view, prediction and the autoscaler).
Time is a parameter (a ``clock`` callable) so a simulator can drive the same objects."""
