"""What the gateway knows and keeps between requests: the function registry (local or in the
shared store), the shared PostgreSQL state store, the model catalogue, and who may call it
(tokens, scopes, tenants). The ground floor of the platform: imports no other room."""
