"""Every invocation's life as a job: the job and its documents (Replicate's prediction,
server-sent events), the store and its journals (local or shared), retention, webhooks and
their deliveries to allow-listed hosts, failover between gateways. Imports ``fleet``,
``control`` and ``state``."""
