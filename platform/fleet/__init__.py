"""The executors the gateway runs and reaches: providers that start them (local processes,
the zygote's forks, Ray actors, attached executors), their links and lives, the pool that
wires them, dispatch to them, the scaler that sizes them, and what each one holds.
Imports ``control`` and ``state``."""
