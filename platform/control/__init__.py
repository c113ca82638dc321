"""The control plane's decisions, free of HTTP and torch: the cluster view, prediction,
placement, the invocation queue and admission, the autoscaler's policy. Time is a parameter
(a ``clock`` callable) so a simulator can drive the same objects. Imports ``state`` only."""
